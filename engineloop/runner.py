"""Running a probe from the command line: find the engine's environment, check the output path
before starting, probe, write the YAML atomically."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from engineprofiles.errors import EngineProfilesError
from engineprofiles.probe.base import EngineNotInstalled
from engineprofiles.store import shipped_dir

if TYPE_CHECKING:
    from engineprofiles.schema import Profile

REPO = Path(__file__).resolve().parents[1]
ENGINES_DIR = Path(os.environ.get("ENGINEPROFILES_ENGINES", REPO / ".engines"))
ENGINE_MODULE = {"vllm": "vllm", "sglang": "sglang", "transformers": "transformers"}
DEFAULT_VERSION = {"vllm": "0.32.0", "sglang": "0.5.23"}


class OutputNotWritable(EngineProfilesError):
    pass


def install_hint(engine: str) -> str:
    if engine == "transformers":
        return "pip install -e '.[test]' (or pip install transformers)"
    return f"scripts/engine_env.sh {engine} {DEFAULT_VERSION[engine]}"


def engine_importable(engine: str) -> bool:
    return importlib.util.find_spec(ENGINE_MODULE[engine]) is not None


def _version_key(name: str) -> tuple:
    return tuple(int(x) if x.isdigit() else x for x in re.split(r"[.\-]", name))


def find_engine_python(engine: str, env: str | None = None) -> Path:
    """The python of an engine environment made by scripts/engine_env.sh.

    ``env`` may be a venv folder, a python path or a version (``0.28.0``). Without it, the
    newest ready environment of ``engine`` under .engines/ is used."""
    if env:
        p = Path(env)
        candidates = [p / "bin" / "python", p, ENGINES_DIR / f"{engine}-{env}" / "bin" / "python"]
        for c in candidates:
            if c.is_file():
                return c
        raise EngineNotInstalled(
            f"no {engine} environment at {env!r}; make one with `scripts/engine_env.sh {engine} VERSION`"
        )
    ready = [d for d in ENGINES_DIR.glob(f"{engine}-*") if (d / ".ready").exists() and (d / "bin" / "python").exists()]
    if not ready:
        raise EngineNotInstalled(
            f"{engine} is not installed in this environment and no environment made by the scripts "
            f"exists in {ENGINES_DIR}. Make one with `{install_hint(engine)}`."
        )
    ready.sort(key=lambda d: _version_key(d.name[len(engine) + 1:]))
    return ready[-1] / "bin" / "python"


def reexec_in(python: Path, argv: list[str], note: Callable[[str], None]) -> int:
    """Run this same command with the engine environment's python; return its exit code."""
    note(f"running in the {python.parent.parent.name} environment ({python})")
    env = dict(os.environ, ENGINEPROFILES_REEXEC="1")
    env.setdefault("ENGINEPROFILES_DIR", str(shipped_dir()))
    return subprocess.call([str(python), "-m", "engineloop.cli", *argv], env=env)


def output_path(output: str | None) -> tuple[Path | None, bool]:
    """(path or folder, is_folder). Checked before probing: an unwritable target fails early."""
    if output is None or output == "-":
        return None, False
    p = Path(output)
    is_dir = p.is_dir() or output.endswith(os.sep)
    folder = p if is_dir else p.parent
    probe_dir = folder
    while not probe_dir.exists():
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        raise OutputNotWritable(f"cannot write the profile to {output}: {probe_dir} is a file, not a folder")
    if not os.access(probe_dir, os.W_OK | os.X_OK):
        raise OutputNotWritable(f"cannot write the profile to {output}: {probe_dir} is not writable")
    if not is_dir and p.exists() and not os.access(p, os.W_OK):
        raise OutputNotWritable(f"cannot write the profile to {output}: the file is not writable")
    return p, is_dir


def write_profile(profile: Profile, target: Path, is_dir: bool) -> Path:
    path = target / f"{profile.canonical_name}.yaml" if is_dir else target
    return profile.save(path)
