"""Finding profiles: by path, by the name of a shipped profile, or by engine (``vllm``,
``vllm==0.32.0``, ``vllm:eager``: the best fitting shipped profile, see engineprofiles.select).

The shipped profiles live in ``profiles/`` at the root of the project's checkout (each one the
output of a probe run). A wheel carries a copy of them as package data,
``engineprofiles/profiles/*.yaml`` (setup.py copies them at build time). ``$ENGINEPROFILES_DIR``
replaces both (a folder of one's own probes, for example)."""

from __future__ import annotations

import errno
import logging
import os
import stat
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from .errors import EngineProfilesError, ProfileError, ProfileNotFound

if TYPE_CHECKING:
    from .schema import Profile
    from .select import Selection

log = logging.getLogger("engineprofiles.select")

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


def _short(text: str, limit: int = 80) -> str:
    """repr(text), its middle cut out when it is longer than ``limit`` characters."""
    return repr(text) if len(text) <= limit else f"{text[:limit // 2]!r}...{text[-limit // 4:]!r}"


def _is_file(p: Path, text: object) -> bool:
    """Whether ``p`` is a regular file (following a symlink), asking the OS once: nothing there
    (or a symlink loop) is False; a name too long for a file is :class:`ProfileNotFound` and any
    other refusal (no permission to look in a folder on its path) :class:`ProfileError`, never a
    raw OSError."""
    try:
        return stat.S_ISREG(os.stat(p).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as e:
        if e.errno == errno.ELOOP:
            return False
        if e.errno == errno.ENAMETOOLONG:
            raise ProfileNotFound(
                f"no profile file or shipped profile named {_short(str(text))}: the name is too long for a file "
                f"({len(str(text))} characters; the OS says: {e.strerror}); give a profile file's path, a shipped "
                "profile's name or ENGINE[==VERSION][:MODE]") from None
        where = str(p) if len(str(p)) <= 300 else _short(str(p), 300)
        raise ProfileError(f"cannot look for the profile: {e.strerror or e}", source=where) from None


def resolve(name_or_path: str | os.PathLike[str]) -> Path:
    """A path to an existing file, or the file of a shipped profile named ``name_or_path``."""
    _check_kind(name_or_path)
    if not str(os.fspath(name_or_path)).strip():  # Path('') is '.', a folder: say what is wrong instead
        raise ProfileNotFound(f"the profile name is empty ({str(os.fspath(name_or_path))!r}); give a profile file's path, "
                              "a shipped profile's name or ENGINE[==VERSION][:MODE]")
    p = Path(name_or_path)
    if _is_file(p, name_or_path):
        return p
    stem = p.name[:-5] if p.name.endswith(".yaml") else p.name
    candidate = shipped_dir() / f"{stem}.yaml"
    if str(p) == p.name and _is_file(candidate, name_or_path):
        return candidate
    if os.path.lexists(p):  # there is something there, just not a profile file: say what
        what = "a folder" if p.is_dir() else "not a regular file (a device, FIFO, socket or broken link)"
        raise ProfileNotFound(f"{str(name_or_path)!r} is {what}; a profile is a YAML file: give the file's path "
                              "or a shipped profile's name")
    names = shipped_names()
    hint = f"shipped profiles: {', '.join(names)}" if names else f"no profiles are shipped in {shipped_dir()}"
    from .select import engine_version_hint

    spelled = engine_version_hint(str(name_or_path))
    if spelled:
        hint += f"; to choose a profile by engine and version, write {spelled!r}"
    elif "==" in str(name_or_path) or str(name_or_path).endswith(":"):  # an engine spec missing a part
        hint += "; to choose a profile by engine, write ENGINE[==VERSION][:MODE], e.g. vllm==0.32.0 or vllm:eager"
    raise ProfileNotFound(f"no profile file or shipped profile named {str(name_or_path)!r}; {hint}")


def _names_a_file(text: str) -> bool:
    """``text`` is an existing file's path or a shipped profile's name (these come first)."""
    p = Path(text)
    return _is_file(p, text) or (text == p.name and _is_file(shipped_dir() / f"{text}.yaml", text))


def names_engine(text: object) -> bool:
    """``text`` asks for a profile by engine (``vllm``, ``vllm==0.32.0:eager``): a string that is
    written as one and is no file's path and no shipped name."""
    from .select import parse_spec

    return isinstance(text, str) and parse_spec(text) is not None and not _names_a_file(text)


def get_profile(profile: "Profile | str | os.PathLike[str]", *, dtype: Optional[str] = None,
                device: Any = None) -> Profile:
    """A Profile from a Profile, a path, a shipped name, or an engine (``ENGINE[==VERSION][:MODE]``,
    a string that is no file's path and no shipped name: the best fitting shipped profile, chosen
    by :func:`choose` for ``dtype`` and ``device``, the model's when known)."""
    from .schema import Profile, load_profile

    if isinstance(profile, Profile):
        return profile
    _check_kind(profile)
    if names_engine(profile):
        return choose(profile, dtype=dtype, device=device)[0]  # type: ignore[arg-type]
    return load_profile(resolve(profile))


def installed_version(engine: str) -> Optional[str]:
    """The version of ``engine`` installed in this Python, from its distribution's metadata (the
    engine is not imported: vLLM takes seconds); None when it is not installed."""
    import importlib.metadata as md

    from .engines import ENGINES

    for dist in ENGINES[engine].distributions if engine in ENGINES else (engine,):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
        except Exception:  # a broken distribution's metadata: treat as not installed
            continue
    return None


def _device_type(device: Any) -> str:
    """cpu, cuda or rocm (torch names a ROCm GPU "cuda"; profiles name its backend rocm)."""
    if device is None:
        return "cpu"
    kind = getattr(device, "type", None) or str(device).split(":", 1)[0]
    if kind == "cuda":
        import torch

        if getattr(torch.version, "hip", None):
            return "rocm"
    return kind


def _outside_stacklevel() -> int:
    """The stacklevel of warnings.warn (called by our caller) that points at the first frame
    outside this project's packages: the user's call of apply_profile or get_profile."""
    roots = tuple(str(Path(__file__).resolve().parents[1] / pkg) + os.sep
                  for pkg in ("engineprofiles", "emulator", "engineloop"))
    frame = sys._getframe(2)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(roots):
        frame = frame.f_back
        level += 1
    return level


def candidates() -> tuple[list[tuple["Profile", Any]], list[str]]:
    """(profile, Candidate) of every valid profile file in :func:`shipped_dir`, and the names of
    the invalid ones (skipped)."""
    from .schema import load_profile
    from .select import Candidate

    found, invalid = [], []
    for n in shipped_names():
        try:
            p = load_profile(shipped_dir() / f"{n}.yaml")
        except EngineProfilesError:
            invalid.append(n)
            continue
        found.append((p, Candidate.of(n, p)))
    return found, invalid


def choose(spec: str, *, dtype: Optional[str] = None, device: Any = None,
           capability: Optional[str] = None, installed: Optional[str] = None) -> tuple["Profile", "Selection"]:
    """The profile ``spec`` (``ENGINE[==VERSION][:MODE]``) names here, with why.

    The candidates are the profiles in :func:`shipped_dir` (invalid files skipped); what is
    wanted: ``dtype`` and ``device`` (the model's; device type cpu by default), this CPU's
    capability (``capability`` overrides it) and the engine version installed in this Python
    (``installed`` overrides it). The choice (:func:`engineprofiles.select.select`) is logged at
    INFO on the ``engineprofiles.select`` logger; a profile that fits only in part warns
    (:class:`~engineprofiles.errors.MismatchedProfile`: ``VersionMismatch``, ``CapabilityMismatch``)
    with its name and why. Raises :class:`~engineprofiles.errors.UnknownEngine` or
    :class:`~engineprofiles.errors.NoMatchingProfile`."""
    from .select import Wanted, parse_spec, select

    parsed = parse_spec(spec)
    if parsed is None:
        raise ProfileError(f"{spec!r} does not name an engine; write ENGINE[==VERSION][:MODE], e.g. vllm==0.32.0")
    device_type = _device_type(device)
    machine = None
    if capability is None and device_type == "cpu":
        from .machine import this_machine

        machine = this_machine()
        capability = machine.capability
    if installed is None and parsed.version is None:
        installed = installed_version(parsed.engine)
    found, invalid = candidates()
    where = f" in {shipped_dir()}"
    wanted = Wanted.of(parsed, dtype=dtype, device=device_type, capability=capability, installed=installed,
                       machine=machine)
    try:
        chosen = select([c for _, c in found], wanted, where=where)
    except ProfileNotFound as e:
        if invalid:
            e.args = (f"{e.args[0]} (skipped invalid files: {', '.join(invalid)}; `probe-engine validate` says why)",)
        raise
    log.info("%s", chosen.message())
    level = _outside_stacklevel()
    for category, text in chosen.mismatches:
        warnings.warn(text, category, stacklevel=level)
    profile = next(p for p, c in found if c is chosen.candidate)
    return profile, chosen


def shipped_profiles() -> list[tuple[str, Profile]]:
    from .schema import load_profile

    return [(n, load_profile(shipped_dir() / f"{n}.yaml")) for n in shipped_names()]
