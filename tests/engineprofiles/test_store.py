"""Finding profiles: by path or shipped name; anything else is a typed error."""

import os

import pytest

from engineprofiles.errors import EngineProfilesError, ProfileError, ProfileNotFound
from engineprofiles.regions import REGIONS
from engineprofiles.store import get_profile, resolve


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
