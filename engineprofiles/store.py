"""Finding profiles: by path, or by the name of a shipped profile.

The shipped profiles live in ``profiles/`` at the root of the project's checkout (each one the
output of a probe run). A wheel carries a copy of them as package data,
``engineprofiles/profiles/*.yaml`` (setup.py copies them at build time)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ProfileError, ProfileNotFound

if TYPE_CHECKING:
    from .schema import Profile

# The schema (and with it torch) is imported by the functions that load profiles, so that finding
# the folder of shipped profiles stays cheap (probe-engine hands over to an engine environment
# before it loads torch).

ENV_VAR = "ENGINEPROFILES_DIR"
_PACKAGE = Path(__file__).resolve().parent


def shipped_dir() -> Path:
    """The folder of shipped profiles: $ENGINEPROFILES_DIR; else the checkout's ``profiles/`` next
    to the package (an editable install: the canonical folder); else the copy installed with the
    package (``engineprofiles/profiles/``, from a wheel)."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    root = _PACKAGE.parent
    # pyproject.toml marks a checkout: site-packages/profiles, should another distribution make
    # one, is not mistaken for the shipped profiles.
    if (root / "profiles").is_dir() and (root / "pyproject.toml").is_file():
        return root / "profiles"
    return _PACKAGE / "profiles"


def shipped_names() -> list[str]:
    d = shipped_dir()
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


def _check_kind(profile: object) -> None:
    if not isinstance(profile, (str, os.PathLike)) or isinstance(os.fspath(profile), bytes):
        raise ProfileError(
            f"a profile is given as a Profile, a path or a shipped name; got {type(profile).__name__}"
        )


def resolve(name_or_path: str | os.PathLike[str]) -> Path:
    """A path to an existing file, or the file of a shipped profile named ``name_or_path``."""
    _check_kind(name_or_path)
    p = Path(name_or_path)
    if p.is_file():
        return p
    stem = p.name[:-5] if p.name.endswith(".yaml") else p.name
    candidate = shipped_dir() / f"{stem}.yaml"
    if str(p) == p.name and candidate.is_file():
        return candidate
    if os.path.lexists(p):  # there is something there, just not a profile file: say what
        what = "a folder" if p.is_dir() else "not a regular file (a device, FIFO, socket or broken link)"
        raise ProfileNotFound(f"{str(name_or_path)!r} is {what}; a profile is a YAML file: give the file's path "
                              "or a shipped profile's name")
    names = shipped_names()
    hint = f"shipped profiles: {', '.join(names)}" if names else f"no profiles are shipped in {shipped_dir()}"
    raise ProfileNotFound(f"no profile file or shipped profile named {str(name_or_path)!r}; {hint}")


def get_profile(profile: "Profile | str | os.PathLike[str]") -> Profile:
    """A Profile from a Profile, a path or a shipped name."""
    from .schema import Profile, load_profile

    if isinstance(profile, Profile):
        return profile
    _check_kind(profile)
    return load_profile(resolve(profile))


def shipped_profiles() -> list[tuple[str, Profile]]:
    from .schema import load_profile

    return [(n, load_profile(shipped_dir() / f"{n}.yaml")) for n in shipped_names()]
