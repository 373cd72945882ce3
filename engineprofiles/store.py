"""Finding profiles: by path, or by the name of a profile shipped in ``profiles/``."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ProfileNotFound
from .schema import Profile, load_profile

ENV_VAR = "ENGINEPROFILES_DIR"


def shipped_dir() -> Path:
    """The folder of shipped profiles: $ENGINEPROFILES_DIR, else ``profiles/`` next to the package."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "profiles"


def shipped_names() -> list[str]:
    d = shipped_dir()
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


def resolve(name_or_path: str | os.PathLike[str]) -> Path:
    """A path to an existing file, or the file of a shipped profile named ``name_or_path``."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    stem = p.name[:-5] if p.name.endswith(".yaml") else p.name
    candidate = shipped_dir() / f"{stem}.yaml"
    if str(p) == p.name and candidate.is_file():
        return candidate
    names = shipped_names()
    hint = f"shipped profiles: {', '.join(names)}" if names else f"no profiles are shipped in {shipped_dir()}"
    raise ProfileNotFound(f"no profile file or shipped profile named {str(name_or_path)!r}; {hint}")


def get_profile(profile: "Profile | str | os.PathLike[str]") -> Profile:
    """A Profile from a Profile, a path or a shipped name."""
    if isinstance(profile, Profile):
        return profile
    return load_profile(resolve(profile))


def shipped_profiles() -> list[tuple[str, Profile]]:
    return [(n, load_profile(shipped_dir() / f"{n}.yaml")) for n in shipped_names()]
