"""The optional dependencies (pyproject.toml's extras) and the check that names the extra to install.

The base install (torch, pydantic, pyyaml, typer, rich) reads, checks, compares and probes
profiles; it is what goes into an engine's own environment. The trainer side needs more:

- ``emulator``: Triton. Every module of the emulator imports it (also its CPU reference path).
- ``insitu``: HF transformers and Triton: the tiny HF models, the transformers probe, the
  in-situ fit and ``probe-engine mismatch`` (HF models patched by the emulator).
- ``plot``: matplotlib: ``probe-engine plot`` and ``probe-engine mismatch --plot``.

Checked with ``importlib.util.find_spec``: nothing is imported here.
"""

from __future__ import annotations

import importlib.util
import sys

from .errors import MissingDependency

DISTRIBUTION = "engineprofiles"
# extra -> the modules it provides (tests/engineprofiles/test_extras.py checks pyproject.toml agrees).
EXTRAS: dict[str, tuple[str, ...]] = {
    "emulator": ("triton",),
    "insitu": ("transformers", "triton"),
    "plot": ("matplotlib",),
}
# module -> the requirement that installs it, as pyproject.toml's extras write it (the same test checks)
REQUIREMENTS: dict[str, str] = {"triton": "triton>=3.2", "transformers": "transformers>=5.17",
                                "matplotlib": "matplotlib>=3.8"}


def install_hint(extra: str, modules: list[str] | None = None) -> str:
    """A pip command that installs ``modules`` (default: the extra's): the packages themselves (the
    project is not on a package index), and the extra from this checkout where the package runs from one."""
    from pathlib import Path

    reqs = " ".join(f"'{REQUIREMENTS.get(m, m)}'" for m in (modules or EXTRAS[extra]))
    root = Path(__file__).resolve().parents[1]
    checkout = (root / "pyproject.toml").is_file()
    named = f"{DISTRIBUTION}[{extra}]"
    return f"pip install {reqs}" + (f" (the {named} extra: pip install -e '{root}[{extra}]')" if checkout else
                                     f" (the {named} extra)")


def _release(text: str) -> tuple[int, ...]:
    """The leading release numbers of a version string ('5.19.0.dev0' -> (5, 19, 0), '5.17rc1' -> (5, 17))."""
    import re

    out = []
    for part in text.split("+")[0].split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group()))
        if m.end() != len(part):
            break
    return tuple(out)


def too_old(module: str) -> str | None:
    """The installed version of ``module``'s distribution where it is below the floor :data:`REQUIREMENTS` names
    (``name>=X.Y``), else None (also when it is not installed: :func:`missing` says that)."""
    from importlib import metadata

    req = REQUIREMENTS.get(module, "")
    if ">=" not in req:
        return None
    try:
        have = metadata.version(module)
    except metadata.PackageNotFoundError:
        return None
    return have if _release(have) < _release(req.split(">=", 1)[1]) else None


def check_version(module: str, what: str) -> None:
    """Raise :class:`MissingDependency` where ``module`` is installed in a version below the project's floor."""
    have = too_old(module)
    if have is not None:
        raise MissingDependency(
            f"{what} needs {REQUIREMENTS[module]}; {sys.executable} has {module} {have}: pip install "
            f"'{REQUIREMENTS[module]}'", name=module)


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be imported here."""
    return [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]


def require(extra: str, what: str) -> None:
    """Raise :class:`MissingDependency` naming the extra when ``what`` cannot run here."""
    gone = missing(extra)
    if gone:
        raise MissingDependency(
            f"{what} needs {' and '.join(gone)}, which {'is' if len(gone) == 1 else 'are'} not installed in "
            f"{sys.executable}: {install_hint(extra, gone)}",
            name=gone[0],
        )
    for m in EXTRAS[extra]:
        check_version(m, what)
