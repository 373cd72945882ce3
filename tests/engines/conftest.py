"""One engine run per engine configuration, shared by every test that needs it.

Booting an engine on a tiny model costs about a minute of the 2-core machine; the trainer side of a
mismatch run reads the engine's capture, so tests that need the same engine run (same engine,
model, prompts, sampling and engine environment) share one: the first test runs
``probe-engine mismatch ENGINE ... --save-capture`` against the real engine (the whole path, engine
included), the others ``probe-engine mismatch ... --capture`` of that file with their own trainer
options. The captures live for one test session, in a folder every pytest-xdist worker of the
session sees, under a lock per configuration (a worker that needs a capture another is making
waits for it instead of booting a second engine).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from .envs import REPO


@dataclass
class MismatchRun:
    """One ``probe-engine mismatch`` (or ``localize``) run: its process, its JSON result, and whether it ran the engine
    (False: it read the capture another test's run left)."""

    proc: subprocess.CompletedProcess
    result: dict | None
    ran_engine: bool

    def checked(self) -> dict:
        sys.stdout.write(self.proc.stdout[-4000:])
        assert self.proc.returncode == 0, (f"probe-engine {self.proc.args[3]} failed (rc {self.proc.returncode}):\n"
                                           f"{self.proc.stderr[-4000:]}")
        assert self.result is not None
        return self.result


def _session_folder(tmp_path_factory) -> Path:
    # every xdist worker of this session: the parent of the workers' base folders, one per run
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent / f"engine-captures-{run}") if run else (base / "engine-captures")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def engine_mismatch(tmp_path_factory):
    """``engine_mismatch(engine, engine_args, trainer_args=(), env=None, tmp=..., command="mismatch")``:
    run ``probe-engine COMMAND ENGINE *engine_args *trainer_args`` (``env``: the engine's environment
    variables to set, None as a value removes one, as the engine's default; COMMAND: mismatch or
    localize, which read the same captures), sharing the engine's capture with every other call of
    the session with the same ``engine``, ``engine_args`` and ``env``; ``python``: the interpreter that runs
    probe-engine (default: this one; an engine environment's runs the trainer side where the engine imports)."""
    from filelock import FileLock

    folder = _session_folder(tmp_path_factory)

    def run(engine: str, engine_args: list[str], trainer_args: list[str] = (), env: dict | None = None, *,
            tmp: Path, timeout: int = 1200, command: str = "mismatch", python: str | None = None) -> MismatchRun:
        env = dict(env or {})
        key = hashlib.sha256(json.dumps([engine, list(engine_args), sorted(env.items())]).encode()).hexdigest()[:16]
        cap = folder / f"{engine}-{key}.pt"
        full_env = {k: v for k, v in os.environ.items() if k not in env or env[k] is not None}
        full_env.update({k: v for k, v in env.items() if v is not None})
        out = tmp / f"{command}.json"
        with FileLock(str(cap) + ".lock"):
            ran_engine = not cap.exists()
            source = [*engine_args, "--save-capture", str(cap)] if ran_engine else ["--capture", str(cap)]
            # --capture takes the model's size and family from the capture (the size options must go)
            if not ran_engine:
                source += _kept_with_capture(engine_args)
            proc = subprocess.run([python or sys.executable, "-m", "engineloop.cli", command, engine, *source,
                                   *trainer_args, "--json", str(out)],
                                  cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env)
        result = json.loads(out.read_text()) if proc.returncode == 0 and out.exists() else None
        return MismatchRun(proc, result, ran_engine)

    return run


# options of an engine run that a run from its capture takes again (what the trainer side reads);
# the rest (model size, prompts, sampling) come from the capture
_WITH_CAPTURE = {"--family": 1, "--mode": 1, "--rope-scaling": 1, "--batch-check": 0, "--model": 1}


def _kept_with_capture(args: list[str]) -> list[str]:
    kept, i = [], 0
    while i < len(args):
        n = _WITH_CAPTURE.get(args[i])
        if n is not None:
            kept += args[i:i + 1 + n]
        i += 1 + (n or 0) if n is not None else 1
    return kept


@pytest.fixture(scope="session")
def op_level_probe(tmp_path_factory):
    """``op_level_probe(engine, version, *args)``: the profile file of ``probe-engine ENGINE --op-level *args`` run in that
    engine's environment on this machine, once per session (test_real_engines compares it with the shipped
    profile; test_check_engine uses it where the shipped one is of another vector ISA). Returns (process, path);
    the path exists only where the probe succeeded."""
    from filelock import FileLock

    folder = _session_folder(tmp_path_factory)

    def run(engine: str, version: str, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
        python = REPO / ".engines" / f"{engine}-{version}" / "bin" / "python"
        key = hashlib.sha256(json.dumps(list(args)).encode()).hexdigest()[:8] if args else "all"
        out = folder / f"op-level-{engine}-{version}-{key}.yaml"
        log = folder / f"op-level-{engine}-{version}-{key}.json"
        with FileLock(str(out) + ".lock"):
            if not log.exists():
                env = dict(os.environ, ENGINEPROFILES_REEXEC="1")
                r = subprocess.run([str(python), "-m", "engineloop.cli", engine, "--op-level", *args, "-o", str(out)],
                                   cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
                log.write_text(json.dumps([r.args, r.returncode, r.stdout, r.stderr]))
            args, rc, stdout, stderr = json.loads(log.read_text())
        return subprocess.CompletedProcess(args, rc, stdout, stderr), out

    return run
