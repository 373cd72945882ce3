"""The engine environments the engine tests run: a missing one is a failure, never a skip."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The batch check's engine run: six prompts of 150-154 tokens, long enough for vLLM's CPU attention to
# split a decode context (test_batch_check_engine, and test_exact_mode's batched rows on the same run).
LONG = ["--prompts", "6", "--prompt-len", "150", "--max-tokens", "24"]
BATCH_RUN = ["--family", "qwen2", *LONG, "--batch-check"]
SPLIT_KV_DEFAULT = {"VLLM_CPU_ATTN_SPLIT_KV": None}  # the engine's default (on); None removes the variable
# The op-level probe's options on a machine of another vector ISA than the shipped op-level profile's, where no
# claim is made about attention or the MoE experts (test_real_engines, test_check_engine: one probe, shared):
# the four regions (attention's fit and the experts took over 7 minutes of SGLang's probe on AVX2, 2026-12-07).
REGIONS_ONLY = [a for r in ("rope", "swiglu", "add_rmsnorm", "rmsnorm") for a in ("--region", r)]


def small_run(family: str, mode: str, rope: str | None = None) -> list[str]:
    """The engine run of the tiny model (test_exact_mode, test_localize_engine): two prompts, 16 sampled
    tokens each."""
    return ["--family", family, "--mode", mode, "--prompts", "2", "--max-tokens", "16",
            *(["--rope-scaling", rope] if rope else [])]


def require_env(engine: str, version: str) -> Path:
    """The ready environment of ``engine`` ``version`` under .engines/, or the test fails saying how to make it."""
    env = REPO / ".engines" / f"{engine}-{version}"
    if not (env / ".ready").exists():
        pytest.fail(f"the {engine} {version} environment is missing: run `scripts/engine_env.sh {engine} {version}` "
                    "(scripts/test.sh does this). Engine tests are not skipped.", pytrace=False)
    return env


def machine_differences(profile_name: str, emulate: str | None = None) -> list[str]:
    """What differs between the machine ``profile_name`` records and this one (under ``emulate``, as
    scripts/emulate_cpu.sh runs it): empty where the profile's claims are this machine's."""
    from engineprofiles.machine import Machine, differences, this_machine
    from engineprofiles.store import get_profile

    return differences(Machine.of(get_profile(profile_name).engine.settings), this_machine(emulate))


def exact_refused_here(engine: str, version: str, args: list[str], mode: str = "default",
                       profile: str | None = None) -> bool:
    """Exact mode's claim holds on the machine its profile was probed on. Where the profile
    ``probe-engine mismatch ENGINE --exact`` applies here (``profile``, else the shipped one it chooses)
    does not describe this machine, the command must refuse, naming what differs, before the engine
    runs: this runs it with that profile named, asserts the refusal, says so in the run's warnings and
    returns True (the test then claims nothing more). False where the profile is this machine's."""
    import subprocess
    import sys
    import warnings

    from engineloop.mismatch import default_profile_name

    name = profile or default_profile_name(engine, version, mode)
    diffs = machine_differences(name)
    if not diffs:
        return False
    r = subprocess.run([sys.executable, "-m", "engineloop.cli", "mismatch", engine, *args, "--profile", name],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, f"exact mode must refuse {name} on this machine ({diffs}):\n{r.stdout}\n{r.stderr}"
    said = " ".join(r.stderr.split())  # rich wraps the message at the terminal's width
    assert "does not describe the machine here" in said and "Traceback" not in said, r.stderr
    warnings.warn(f"{name} is not this machine's profile ({'; '.join(diffs)}): exact mode refused, as it must; "
                  f"probe this machine (scripts/probe.sh {engine} {version}) for the bit-exact claim", stacklevel=2)
    return True
