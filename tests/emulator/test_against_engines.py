"""Against the engines: a trainer patched with a shipped engine profile reproduces, on fresh inputs,
the evidence that profile was probed from (scripts/check_emulator_vs_engine.py, run in the engine's
own environment).

A missing engine environment is a failure, never a skip: the shipped profiles claim what these
engines do, and the claim that the trainer reproduces them is checked on every run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from engineprofiles.store import shipped_profiles

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "check_emulator_vs_engine.py"
ENGINE_PROFILES = [(n, p) for n, p in shipped_profiles() if p.engine.name != "transformers"]


def engine_python(prof) -> Path:
    e = prof.engine
    env = REPO / ".engines" / f"{e.name}-{e.version}"
    python = env / "bin" / "python"
    if not (python.exists() and (env / ".ready").exists()):
        pytest.fail(
            f"the {e.name} {e.version} environment is missing: run `scripts/engine_env.sh {e.name} {e.version}` "
            "(scripts/test.sh makes the environments). Engine tests are not skipped.",
            pytrace=False,
        )
    return python


def run_check(python: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "EMULATOR_BACKEND")}
    r = subprocess.run([str(python), str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=900)
    sys.stdout.write(r.stdout[-8000:])
    return r


def test_every_shipped_engine_profile_is_checked():
    engines = {p.engine.name for _, p in ENGINE_PROFILES}
    assert {"vllm", "sglang"} <= engines


@pytest.mark.engine
@pytest.mark.parametrize("name,prof", ENGINE_PROFILES, ids=[n for n, _ in ENGINE_PROFILES])
def test_the_patched_trainer_reproduces_the_engine_the_profile_was_probed_from(name, prof):
    r = run_check(engine_python(prof), name)
    assert r.returncode == 0, f"{name}: the patched trainer does not reproduce the engine:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    assert "all regions reproduce the engine" in r.stdout
    assert " FAIL " not in r.stdout
    for line in r.stdout.splitlines():
        if line.startswith("note: the evidence was measured on CPU capability"):
            warnings.warn(f"{name}: {line[6:]}", stacklevel=1)  # shown in the run's warnings summary


@pytest.mark.engine
def test_the_check_fails_when_the_profile_is_wrong(tmp_path):
    # SGLang rounds silu(gate) before the multiply; a profile claiming it does not must fail.
    name, prof = next((n, p) for n, p in ENGINE_PROFILES if p.engine.name == "sglang")
    from engineprofiles.regions import REGIONS
    from engineprofiles.schema import make_profile

    points = {r: prof.point(r) for r in REGIONS}
    points["swiglu"] = REGIONS["swiglu"].point(silu="fp32")
    wrong = make_profile(engine=prof.engine, dtype=prof.dtype, points=points,
                         evidence={r: prof.entry(r).evidence for r in REGIONS}, provenance=prof.provenance)
    path = tmp_path / "wrong.yaml"
    wrong.save(path)
    r = run_check(engine_python(prof), str(path), "--region", "swiglu", "--family", "qwen2")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL" in r.stdout and "swiglu" in r.stdout
