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
    assert set(declared) - set(extras.EXTRAS) == {"test"}, "an extra the messages do not know"


def test_a_missing_module_names_the_extra(monkeypatch):
    monkeypatch.setitem(extras.EXTRAS, "insitu", ("no_such_module_engineprofiles_test", "triton"))
    with pytest.raises(MissingDependency) as e:
        extras.require("insitu", "the thing")
    assert isinstance(e.value, EngineProfilesError) and isinstance(e.value, ImportError)
    assert e.value.name == "no_such_module_engineprofiles_test"
    msg = str(e.value)
    assert "the thing needs no_such_module_engineprofiles_test, which is not installed in" in msg
    assert "pip install 'engineprofiles[insitu]'" in msg and sys.executable in msg


def test_nothing_is_raised_when_the_extra_is_installed():
    extras.require("emulator", "the emulator")  # the test venv has Triton (scripts/requirements-dev.txt)
    assert extras.missing("insitu") == []
