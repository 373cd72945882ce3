"""Exact mode against vLLM's AVX2 build: natively on a host without AVX-512, emulated on an AVX-512 host
(scripts/emulate_cpu.sh avx2).

`scripts/emulate_cpu.sh avx2 probe-engine mismatch vllm --exact` runs the engine with torch's and
oneDNN's AVX2 code paths and vLLM's `_C_AVX2` kernel library, and the trainer with torch at AVX2, so
exact mode loads the shipped `-avx2` profile, whose attention entry is vLLM's AVX2 kernel (glibc's
expf, two 8-lane halves summed in order, a truncated BF16 output). The exact rows must be bit-exact.
On an AVX2 host the same claims are checked on the native run (test_exact_mode's qwen2 engine run, shared).
The shipped `-avx2` profile was probed on a real AVX2 CPU (2026-12-07): under emulation on an AVX-512 host it
is another machine's, and exact mode must refuse it. A missing engine environment is a failure; nothing here
is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest

from engineprofiles.store import get_profile

from .envs import REPO, exact_refused_here, machine_differences, require_env, small_run

VERSION = "0.32.0"
AVX2_PROFILE = f"vllm-{VERSION}-cpu-inductor-bfloat16-insitu-avx2"


def _host_has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512f " in f.read()
    except OSError:
        return False


@pytest.mark.engine
def test_exact_mode_reproduces_the_avx2_engines_log_probs(engine_mismatch, tmp_path):
    require_env("vllm", VERSION)
    if not _host_has_avx512():
        # the host runs vLLM's AVX2 build natively: the run of test_exact_mode's qwen2 case (its shared capture)
        if exact_refused_here("vllm", VERSION, ["--family", "qwen2", "--exact"]):
            return
        d = engine_mismatch("vllm", small_run("qwen2", "default"), ["--exact"], tmp=tmp_path).checked()
        _assert_avx2_exact(d)
        return
    out = tmp_path / "m.json"
    cmd = [str(REPO / "scripts" / "emulate_cpu.sh"), "avx2", sys.executable, "-m", "engineloop.cli", "mismatch", "vllm",
           "--family", "qwen2", "--exact", "--prompts", "2", "--json", str(out)]
    other = machine_differences(AVX2_PROFILE, emulate="avx2")
    if other:  # the -avx2 profile was probed on another host class: exact mode must refuse it here
        r = subprocess.run([*cmd, "--profile", AVX2_PROFILE], cwd=REPO, capture_output=True, text=True, timeout=600)
        said = " ".join(r.stderr.split())  # rich wraps the message at the terminal's width
        assert r.returncode == 2 and "does not describe the machine here" in said, r.stdout + r.stderr
        warnings.warn(f"{AVX2_PROFILE} was probed on another host ({other}): exact mode refused, as it must",
                      stacklevel=1)
        return
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1500, env=dict(os.environ))
    sys.stdout.write(r.stdout[-4000:])
    assert r.returncode == 0, f"emulated probe-engine mismatch failed (rc {r.returncode}):\n{r.stderr[-4000:]}"
    _assert_avx2_exact(json.loads(out.read_text()))


def _assert_avx2_exact(d: dict) -> None:
    assert d["engine"].get("cpu_capability") == "AVX2", d["engine"]  # the engine took the AVX2 paths
    prof = get_profile(d["profile"])
    assert prof.engine.settings.get("cpu_capability") == "AVX2" and d["profile"].endswith("-avx2"), d["profile"]
    att = prof.attention.variants
    assert (att.exp, att.row_sum, att.output) == ("glibc_expf", "lanes16_halves_sequential", "truncate")
    assert prof.attention.evidence.match_rate == 1.0
    rows = {k: {x["trainer"]: x for x in d[k]} for k in ("sampled", "prefill")}
    for k in ("sampled", "prefill"):
        ex = rows[k]["exact"]
        assert ex["exact_match"] == 1.0 and ex["abs_dlogp_max"] == 0.0, (k, ex)
        # and the test could fail: the profile alone does not match every token
        assert rows[k]["+ engine profile"]["exact_match"] < 1.0, (k, rows[k]["+ engine profile"])


@pytest.mark.engine
def test_the_avx2_kernel_op_is_the_avx2_point_and_its_exp_is_glibcs(tmp_path):
    """scripts/check_avx2_attention.py: the _C_AVX2 kernel op on the probe's inputs equals the AVX2 point
    bit for bit (the AVX512 point does not), and on inputs built so that glibc's expf and the correctly
    rounded exp give different outputs, the kernel gives glibc's on every such element."""
    env = require_env("vllm", VERSION)
    out = tmp_path / "check.json"
    wrap = [str(REPO / "scripts" / "emulate_cpu.sh"), "avx2"] if _host_has_avx512() else []  # else: natively
    r = subprocess.run(
        [*wrap, str(env / "bin" / "python"),
         str(REPO / "scripts" / "check_avx2_attention.py"), "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=1200, env=dict(os.environ),
    )
    sys.stdout.write(r.stdout[-3000:])
    assert out.exists(), f"check_avx2_attention.py failed (rc {r.returncode}):\n{r.stderr[-4000:]}"
    d = json.loads(out.read_text())
    assert d["kernel_libraries"] == ["_C_AVX2.abi3.so"] and d["cpu_capability"] == "AVX2", d
    p = d["probe_inputs"]
    assert p["avx2_point"]["matched"] == p["avx2_point"]["total"] > 0
    assert p["avx512_point"]["matched"] < p["avx512_point"]["total"]
    t = d["exp_discriminating"]
    assert t["elements_differing"] > 0, t  # the inputs told the two exps apart
    assert t["kernel_equals_glibc"] == t["elements_differing"] and t["kernel_equals_correctly_rounded"] == 0, t
    assert t["calls_equal_to_avx2_point_everywhere"] == t["calls"], t
    assert r.returncode == 0 and d["ok"]
