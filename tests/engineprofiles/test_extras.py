"""The extras: engineprofiles.extras (what the messages name) agrees with pyproject.toml, and a
missing module is a MissingDependency naming the extra to install."""

import sys
import tomllib
from pathlib import Path

import pytest

from engineprofiles import extras
from engineprofiles.errors import EngineProfilesError, MissingDependency

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
MODULE_OF = {"transformers": "transformers", "triton": "triton", "matplotlib": "matplotlib"}  # distribution -> module it provides


def _name(requirement: str) -> str:
    for sep in "<>=!~;[ ":
        requirement = requirement.split(sep, 1)[0]
    return requirement.strip().lower()


def test_the_extras_agree_with_pyproject():
    declared = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    for extra, modules in extras.EXTRAS.items():
        assert extra in declared, f"pyproject.toml has no extra {extra!r}"
        assert sorted(MODULE_OF[_name(r)] for r in declared[extra]) == sorted(modules), extra
        for r in declared[extra]:  # the hint installs what pyproject.toml asks for
            assert extras.REQUIREMENTS[MODULE_OF[_name(r)]] == r, (extra, r)
    assert set(declared) - set(extras.EXTRAS) == {"test"}, "an extra the messages do not know"


def test_a_missing_module_names_the_extra(monkeypatch):
    monkeypatch.setitem(extras.EXTRAS, "insitu", ("no_such_module_engineprofiles_test", "triton"))
    with pytest.raises(MissingDependency) as e:
        extras.require("insitu", "the thing")
    assert isinstance(e.value, EngineProfilesError) and isinstance(e.value, ImportError)
    assert e.value.name == "no_such_module_engineprofiles_test"
    msg = str(e.value)
    assert "the thing needs no_such_module_engineprofiles_test, which is not installed in" in msg
    assert sys.executable in msg
    # an install that works: the missing packages themselves (the project is on no package index), and
    # the extra from this checkout
    assert f"pip install -e '{PYPROJECT.parent}[insitu]'" in msg and "pip install 'engineprofiles[" not in msg


def test_the_hint_installs_the_missing_packages_with_the_floors_pyproject_asks():
    assert extras.install_hint("insitu", ["triton"]).startswith("pip install 'triton>=3.2' ")
    assert extras.install_hint("insitu").startswith("pip install 'transformers>=5.17' 'triton>=3.2' ")


def test_the_torch_floor_is_one_the_extras_triton_runs_with():
    """triton 3.2 is the Triton of torch 2.6: a base torch below it cannot take the emulator's Triton."""
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    torch_req = next(d for d in deps if _name(d) == "torch")
    assert torch_req == "torch>=2.6", torch_req


def test_nothing_is_raised_when_the_extra_is_installed():
    extras.require("emulator", "the emulator")  # the test venv has Triton (scripts/requirements-dev.txt)
    assert extras.missing("insitu") == []


@pytest.mark.parametrize("installed,refused", [("4.57.6", True), ("5.10.4", True), ("5.16.99", True),
                                               ("5.17.0", False), ("5.17.0rc1", False), ("5.19.0.dev0", False),
                                               ("6.0", False)])
def test_a_transformers_below_the_floor_is_refused_naming_the_installed_version(monkeypatch, installed, refused):
    """verl 0.9.1 pins transformers < 5.11; the patched attention needs 5.17's AttentionInterface.get_interface."""
    from importlib import metadata

    from engineprofiles import extras
    from engineprofiles.errors import MissingDependency

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda d: installed if d == "transformers" else real(d))
    if refused:
        with pytest.raises(MissingDependency) as e:
            extras.require("insitu", "the test")
        said = str(e.value)
        assert f"transformers {installed}" in said and "transformers>=5.17" in said
    else:
        extras.require("insitu", "the test")


def test_model_patching_refuses_an_old_transformers_at_import():
    import subprocess

    code = ("from importlib import metadata\nreal = metadata.version\n"
            "metadata.version = lambda d: '5.10.4' if d == 'transformers' else real(d)\n"
            "import emulator\ntry:\n    emulator.apply_profile\nexcept Exception as e:\n"
            "    print(type(e).__name__, e)\nelse:\n    print('imported')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("MissingDependency") and "transformers 5.10.4" in r.stdout, r.stdout
