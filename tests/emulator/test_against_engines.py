"""Against the engines: a trainer patched with a shipped engine profile reproduces, on fresh inputs,
the evidence that profile was probed from (scripts/check_emulator_vs_engine.py, run in the engine's
own environment).

A missing engine environment is a failure, never a skip: the shipped profiles claim what these
engines do, and the claim that the trainer reproduces them is checked on every run.

An in-situ profile's claim holds on the machine it was probed on (engineprofiles.machine): the test
computes from this machine's features whether the profile fits it. Where it fits, the check must
pass; where it does not (an AMX machine and a profile probed without AMX, say), the check must refuse
(exit 3) naming what differs, and the test says so in the run's warnings. An op-level profile's claim holds
on the vector ISA it was probed on (AVX2, AVX512): on another the check must refuse the same way. A profile probed under an
emulated capability (scripts/emulate_cpu.sh) is checked under the same emulation where this host can
emulate it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from engineprofiles.machine import EMULATED_ISA, Machine, differences, this_machine
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


def emulation(prof) -> str | None:
    """The capability the profile's probe emulated (scripts/emulate_cpu.sh), if this host can emulate it."""
    if not prof.engine.settings.get("cpu_emulated"):
        return None
    cap = str(prof.engine.settings.get("cpu_capability", "")).lower()
    return cap if cap in EMULATED_ISA and "avx512f" in (this_machine().flags or ()) else None


def run_check(python: Path, *args: str, emulate: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "EMULATOR_BACKEND")}
    pre = [str(REPO / "scripts" / "emulate_cpu.sh"), emulate] if emulate else []
    r = subprocess.run([*pre, str(python), str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=900)
    sys.stdout.write(r.stdout[-8000:])
    return r


def test_every_shipped_engine_profile_is_checked():
    engines = {p.engine.name for _, p in ENGINE_PROFILES}
    assert {"vllm", "sglang"} <= engines


@pytest.mark.engine
@pytest.mark.parametrize("name,prof", ENGINE_PROFILES, ids=[n for n, _ in ENGINE_PROFILES])
def test_the_patched_trainer_reproduces_the_engine_the_profile_was_probed_from(name, prof):
    # Checked natively (an emulated profile under scripts/emulate_cpu.sh missed 0.3% of the second layer's q/k
    # in profile mode, as a real AVX2 CPU does: scripts/check_emulator_vs_engine.py says why).
    recorded, here = Machine.of(prof.engine.settings), this_machine()
    diffs = differences(recorded, here)
    r = run_check(engine_python(prof), name)
    if prof.provenance.method != "in-situ" and recorded.capability != here.capability:
        # An op-level profile of another vector ISA: the engine's kernels take other paths here (vLLM's eager
        # RoPE does on AVX2), so the check must refuse before running the engine, and say how to probe here.
        assert r.returncode == 3, f"{name}: probed on {recorded.capability}, this machine is {here.capability}; the " \
                                  f"check must refuse:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
        assert r.stdout.startswith("refused: ") and "vector ISA" in r.stdout and "--op-level" in r.stdout, r.stdout
        warnings.warn(f"{name}: probed on {recorded.capability}, this machine has {here.capability}: the check "
                      "refused as it must", stacklevel=1)
        return
    if prof.provenance.method == "in-situ" and diffs:
        # The profile was probed on another machine: the check must refuse, naming what differs.
        assert r.returncode == 3, f"{name}: probed on another machine ({diffs}), the check must refuse:\n" \
                                  f"{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
        assert r.stdout.startswith("refused: ") and all(d.split(":")[0] in r.stdout for d in diffs), r.stdout
        warnings.warn(f"{name}: not this machine's profile; the check refused as it must ({'; '.join(diffs)})",
                      stacklevel=1)
        return
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
    # recorded as this machine's (an op-level profile of another vector ISA is refused before it is run)
    engine = prof.engine.model_copy(update={"settings": {**prof.engine.settings, **this_machine().settings()}})
    wrong = make_profile(engine=engine, dtype=prof.dtype, points=points,
                         evidence={r: prof.entry(r).evidence for r in REGIONS}, provenance=prof.provenance)
    path = tmp_path / "wrong.yaml"
    wrong.save(path)
    r = run_check(engine_python(prof), str(path), "--region", "swiglu", "--family", "qwen2")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL" in r.stdout and "swiglu" in r.stdout


@pytest.mark.engine
def test_the_in_situ_check_refuses_a_profile_of_another_machine(tmp_path):
    # The must-fail control of the machine rule: a vLLM in-situ profile recording this machine with one
    # feature toggled (AMX) is another machine's profile, which the check refuses (exit 3) before running
    # the engine, whatever machine this is.
    name, prof = next((n, p) for n, p in ENGINE_PROFILES
                      if p.provenance.method == "in-situ" and p.engine.name == "vllm" and emulation(p) is None)
    here = this_machine().settings()
    here["cpu_isa"] = sorted(set(here["cpu_isa"]) ^ {"amx_tile"})
    data = yaml.safe_load(prof.to_yaml())
    data["engine"]["settings"].update(here)
    path = tmp_path / "other-machine.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    r = run_check(engine_python(prof), str(path))
    assert r.returncode == 3, r.stdout + r.stderr
    assert "refused: " in r.stdout and "amx_tile" in r.stdout and "scripts/probe.sh vllm" in r.stdout
