"""Running a probe from the command line: find the engine's environment, check the output path
before starting, probe, write the YAML atomically."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from engineprofiles import engines
from engineprofiles.errors import OutputNotWritable
from engineprofiles.files import check_writable_folder, file_target
from engineprofiles.names import is_safe_name
from engineprofiles.probe.base import EngineNotInstalled
from engineprofiles.store import shipped_dir

if TYPE_CHECKING:
    from engineprofiles.schema import Profile

REPO = Path(__file__).resolve().parents[1]  # the checkout, in an editable install; site-packages otherwise
ENGINES_VAR = "ENGINEPROFILES_ENGINES"
ENGINES_DIR = Path(os.environ.get(ENGINES_VAR) or REPO / ".engines")  # empty: unset, as $ENGINEPROFILES_DIR


def install_hint(engine: str) -> str:
    return engines.get(engine).hint()


def in_checkout() -> bool:
    """Whether this package runs from a checkout of the project (an editable install), where
    scripts/engine_env.sh makes the engine environments in .engines/."""
    return (REPO / "scripts" / "engine_env.sh").is_file()


def _engines_source() -> str:
    """Where ENGINES_DIR comes from, in words."""
    if os.environ.get(ENGINES_VAR) and Path(os.environ[ENGINES_VAR]) == ENGINES_DIR:
        return f"${ENGINES_VAR}"
    if ENGINES_DIR == REPO / ".engines":
        return "the checkout's .engines/" if in_checkout() else \
            f"the default next to the installed package, which is not a checkout of the project; ${ENGINES_VAR} is not set"
    return "the folder of engine environments"


def engine_importable(engine: str) -> bool:
    return importlib.util.find_spec(engines.get(engine).module) is not None


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
                if not os.access(c, os.X_OK):
                    raise EngineNotInstalled(
                        f"--env {env!r}: {c} is not executable; point --env at an environment made by "
                        f"`scripts/engine_env.sh {engine} VERSION` (its folder, its bin/python or its version)"
                    )
                return c
        raise EngineNotInstalled(
            f"no {engine} environment at {env!r} (looked for {', '.join(map(str, candidates))}); make one with "
            f"`scripts/engine_env.sh {engine} VERSION` in the project's checkout"
        )
    ready = [d for d in ENGINES_DIR.glob(f"{engine}-*") if (d / ".ready").exists() and (d / "bin" / "python").exists()]
    if not ready:
        if not engines.get(engine).has_environment():
            raise EngineNotInstalled(f"{engine} is not installed in this environment: {install_hint(engine)}")
        raise EngineNotInstalled(
            f"{engine} is not installed in this environment, and no environment made by scripts/engine_env.sh was "
            f"found: looked for {ENGINES_DIR / engine}-VERSION/ with bin/python and a .ready marker "
            f"({_engines_source()}). Make one with `{install_hint(engine)}` in the project's checkout (it makes "
            f".engines/{engine}-VERSION there, where an editable install of that checkout looks); or set {ENGINES_VAR} "
            "to a folder that holds such environments, or pass --env VENV"
        )
    ready.sort(key=lambda d: _version_key(d.name[len(engine) + 1:]))
    return ready[-1] / "bin" / "python"


def reexec_in(python: Path, argv: list[str], note: Callable[[str], None], codes: tuple[int, ...] = (0, 2)) -> int:
    """Run this same command with the engine environment's python; return its exit code (2, with
    a message, when that python could not run it or ended without an exit status of its own).
    ``codes``: the exit statuses the command itself ends with (``check`` adds 1)."""
    note(f"running in the {python.parent.parent.name} environment ({python})")
    env = dict(os.environ, ENGINEPROFILES_REEXEC="1")
    env.setdefault("ENGINEPROFILES_DIR", str(shipped_dir()))
    try:
        code = subprocess.call([str(python), "-m", "engineloop.cli", *argv], env=env)
    except OSError as e:
        raise EngineNotInstalled(
            f"cannot run {python} ({e.strerror or e}); is it the python of an environment made by scripts/engine_env.sh?"
        ) from None
    if code not in codes:  # probe-engine exits 0, or 2 after an error: line of its own (check: 1 on drift)
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        note(f"error: {python} {how} before the probe finished; is it the python of an environment made by "
             "scripts/engine_env.sh (see its output above, if any)?")
        return 2
    return code


def environment_of(engine: str, version: str) -> Path | None:
    """The python of the ready environment of exactly ``engine`` ``version`` under ENGINES_DIR, if any."""
    d = ENGINES_DIR / f"{engine}-{version}"
    python = d / "bin" / "python"
    return python if (d / ".ready").exists() and python.is_file() else None


def _shipped_folders() -> set[str]:
    return {os.path.realpath(shipped_dir()), os.path.realpath(REPO / "profiles")}


def check_output_file(path: str | os.PathLike[str], what: str) -> Path:
    """A file output (a profile, --json, --plot) checked before any work: a regular file or a new
    path, in a folder where files can be created."""
    p = Path(path)
    target = file_target(p)
    check_writable_folder(target.parent, f"{what} to {p}")
    if target.exists() and not os.access(target, os.W_OK):
        raise OutputNotWritable(f"cannot write {what} to {p}: the file is not writable")
    return p


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether two paths name one file: the same resolved path (symlinks, ``./`` and ``..`` spellings),
    or, both existing, the same inode (a hard link)."""
    try:
        if os.path.realpath(a) == os.path.realpath(b):
            return True
        return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def in_shipped_folder(path: str | os.PathLike[str]) -> bool:
    """Whether a write to ``path`` (through its symlink) lands in the folder of shipped profiles."""
    try:
        folder = file_target(path).parent
    except OutputNotWritable:
        return False
    return os.path.realpath(folder) in _shipped_folders()


def check_outputs(outputs: list[tuple[str, str | None]], inputs: list[tuple[str, str | None]] = (),
                  ship: bool | None = None) -> None:
    """Every output of one command, (option, path) with None for an option not given, checked before any
    work: ``-`` (stdout) at most once; each file writable (:func:`check_output_file`); none in the folder
    of shipped profiles unless ``ship`` (None: the command has no --ship, so never); none the same file
    as an input of the run (``inputs``: (what, path) of the files it reads; the ones that exist) or as
    another output. Raises :class:`OutputNotWritable`, having written nothing."""
    given = [(opt, str(p)) for opt, p in outputs if p]
    stdout = [opt for opt, p in given if p == "-"]
    if len(stdout) > 1:
        raise OutputNotWritable(f"{' and '.join(stdout)} both write to stdout ('-'): give all but one of them a file")
    files = [(opt, p) for opt, p in given if p != "-"]
    for opt, p in files:
        check_output_file(p, opt)
        if not ship and in_shipped_folder(p):
            how = ("pass --ship to write (and overwrite) a shipped profile there, or write elsewhere" if ship is not None
                   else "this command never writes there; write elsewhere")
            raise OutputNotWritable(f"{opt} {p} is in the folder of shipped profiles ({shipped_dir()}), where only a "
                                    f"probe with --ship writes (scripts/probe.sh ... --ship): {how}")
        for what, q in inputs:
            if q and q != "-" and os.path.exists(q) and same_file(p, q):
                raise OutputNotWritable(f"{opt} {p} is {what} {q}, which this command reads: writing it would replace "
                                        "its input; write to another path")
    for i, (opt, p) in enumerate(files):
        for opt2, p2 in files[i + 1:]:
            if same_file(p, p2):
                raise OutputNotWritable(f"{opt} {p} and {opt2} {p2} are the same file: the second write would replace "
                                        "the first; give each its own path")


def write_output(path: str, data: str | bytes) -> str:
    """Write an output checked by :func:`check_outputs`: ``-`` to stdout (bytes as they are), a file
    atomically. Returns where it went, for a message."""
    if path == "-":
        import sys

        stream = sys.stdout
        stream.flush()
        if isinstance(data, bytes):
            stream.buffer.write(data)
            stream.buffer.flush()
        else:
            stream.write(data if data.endswith("\n") else data + "\n")
            stream.flush()
        return "stdout"
    from engineprofiles.files import write_atomic

    write_atomic(Path(path), data)
    return path


def output_path(output: str | None, ship: bool = False,
                inputs: list[tuple[str, str | None]] = ()) -> tuple[Path | None, bool]:
    """(path or folder, is_folder). Checked before probing: an unwritable target fails early, and
    so does one in the folder of shipped profiles without ``ship``, and a file that is one of the
    run's ``inputs`` ((what, path), as for :func:`check_outputs`). None for '-' (stdout)."""
    if output is None or output == "-":
        return None, False
    p = Path(output)
    is_dir = p.is_dir() or output.endswith(os.sep)
    if is_dir:
        folder = p
    else:
        try:
            folder = file_target(p).parent
        except OutputNotWritable as e:
            raise OutputNotWritable(f"{e} (-o - prints the profile to stdout)") from None
    if not ship and os.path.realpath(folder) in _shipped_folders():
        raise OutputNotWritable(
            f"{output} is in the folder of shipped profiles ({folder}), which only `scripts/probe.sh ... --ship` "
            "writes: pass --ship to write (and overwrite) a shipped profile there, or -o another folder"
        )
    if is_dir:
        check_writable_folder(p, f"the profile to {output}")
    else:
        check_output_file(p, "the profile")
        check_outputs([("-o", output)], inputs, ship=True)  # (the shipped folder is checked above)
    return p, is_dir


def write_profile(profile: Profile, target: Path, is_dir: bool) -> Path:
    name = profile.canonical_name
    if not is_safe_name(name) or name in (".", ".."):
        raise OutputNotWritable(f"the profile's canonical name {name!r} is not a plain file name; not writing it")
    path = target / f"{name}.yaml" if is_dir else target
    return profile.save(path)
