import hashlib
import os
import stat
from pathlib import Path

import pytest

from engineprofiles.regions import REGIONS
from engineprofiles.schema import make_profile


def pytest_collection_modifyitems(config, items):
    """The engine tests first (each runs a real engine for a minute or more): where scripts/test.sh runs
    the suite in several processes (TEST_WORKERS; pytest-xdist, --dist load --maxschedchunk 1: one test
    at a time to whichever worker is free), the long tests spread over the workers from the start and
    the short ones fill the gaps. (With larger chunks, or worksteal's halves, one worker got every
    engine test.)"""
    items.sort(key=lambda item: item.get_closest_marker("engine") is None)  # stable: the order within each


def synthetic_profile(points=None, **engine):
    points = points or {n: s.all_points()[-1] for n, s in REGIONS.items()}
    eng = dict(name="synthetic", version="0.0", backend="cpu", device="test-cpu", torch_version="2.13.0",
               execution_mode="eager")
    eng.update(engine)
    return make_profile(
        engine=eng,
        dtype="bfloat16",
        points=points,
        evidence={n: {"match_rate": 1.0, "elements": 100, "shapes": ["tokens=1"], "path": "reference"} for n in REGIONS},
        provenance=dict(date="2026-12-02T00:00:00Z", probe_version="1", package_version="0.1.0", method="synthetic",
                        command="pytest"),
    )


@pytest.fixture
def profile():
    return synthetic_profile()


@pytest.fixture
def profile_file(tmp_path, profile):
    path = tmp_path / "good.yaml"
    profile.save(path)
    return path


# -- what no command in the test suite may change (issue 17) --------------------------------------

SPECIAL_FILES = ("/dev/null", "/dev/full", "/dev/zero")
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "profiles"


def _snapshot() -> dict[str, tuple]:
    snap: dict[str, tuple] = {}
    for f in SPECIAL_FILES:
        if os.path.lexists(f):
            st = os.lstat(f)
            snap[f] = (stat.S_IFMT(st.st_mode), st.st_mode & 0o7777, st.st_rdev)
    for f in sorted(SHIPPED_DIR.iterdir()):
        st = os.lstat(f)
        snap[str(f)] = (stat.S_IFMT(st.st_mode), st.st_mode & 0o7777, hashlib.sha256(f.read_bytes()).hexdigest())
    return snap


@pytest.fixture(autouse=True, scope="session")
def _special_files_modes_and_shipped_profiles_are_unchanged():
    before = _snapshot()
    yield
    after = _snapshot()
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, f"the test suite changed {changed}"


@pytest.fixture(autouse=True)
def _never_replace_a_special_file(monkeypatch):
    """A safety net: were a regression to let a write replace a device or a FIFO (as root it can),
    the test fails here instead of damaging the machine."""
    real_replace, real_rename = os.replace, os.rename

    def guard(real):
        def guarded(src, dst, *a, **k):
            try:
                st = os.stat(dst)
            except (FileNotFoundError, NotADirectoryError):
                st = None
            if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                raise AssertionError(f"a test tried to replace the special file {dst}")
            return real(src, dst, *a, **k)

        return guarded

    monkeypatch.setattr(os, "replace", guard(real_replace))
    monkeypatch.setattr(os, "rename", guard(real_rename))


def as_schema_version(data: dict, version: int) -> dict:
    """A current profile's YAML data as an older schema version wrote it (engineprofiles.schema.as_version)."""
    from engineprofiles.schema import as_version

    return as_version(data, version)


def assert_as_the_tool_wrote_it(path, profile) -> None:
    """``path`` holds what the tool writes for ``profile``: its own bytes when it is of the current
    schema version. A file written under an older version (shipped profiles keep the version of the
    probe run that wrote them) loads through the migration: the dump then differs from the file only
    in what the migration adds (the version number, evidence scope, the moe and shared_expert entries), and round-trips to itself."""
    import yaml

    from engineprofiles.schema import ENTRY_SINCE, SCHEMA_VERSION, profile_from_yaml

    text = Path(path).read_text(encoding="utf-8")
    dumped = profile.to_yaml()
    if yaml.safe_load(text)["schema_version"] == SCHEMA_VERSION:
        assert dumped == text, f"{path} is not what the tool writes for it"
        return
    assert profile_from_yaml(dumped).to_yaml() == dumped
    lines = dumped.splitlines()
    # Entries the migration adds, each "not probed" with the version the file was written under.
    for entry, after in (("moe", "shared_expert:"), ("shared_expert", "provenance:")):
        entry, before = entry + ":", ENTRY_SINCE[entry] - 1
        if entry not in text.splitlines():
            start, end = lines.index(entry), lines.index(after)
            assert f"reason: 'not probed: the profile was written with schema version {before}" in "\n".join(
                lines[start:end])
            lines = lines[:start] + lines[end:]
    added = [ln for ln in lines if ln not in text.splitlines()]
    assert added and all(ln.startswith("schema_version:") or ln.strip() == "scope: whole-model" for ln in added), (
        path, added)
