"""exact mode's split-KV model (engineprofiles.regions.attention.KVSplit) against vLLM's CPU attention
kernel op with ``enable_kv_split`` (the engine's default, VLLM_CPU_ATTN_SPLIT_KV=1): the scheduler's plan
of every call and the kernel's BF16 output on the rows it splits (scripts/check_split_kv_attention.py).
A missing engine environment is a failure. The AVX2 build is checked on every host: natively where the host
has no AVX-512, by emulation (scripts/emulate_cpu.sh) where it has."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .envs import REPO, require_env
from .test_exact_mode_avx2 import _host_has_avx512

VERSION = "0.32.0"


def _check(tmp_path, wrap: list[str]) -> dict:
    env = require_env("vllm", VERSION)
    out = tmp_path / "split.json"
    r = subprocess.run([*wrap, str(env / "bin" / "python"), str(REPO / "scripts" / "check_split_kv_attention.py"),
                        "--quick", "--json", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    sys.stdout.write(r.stdout[-3000:])
    assert out.exists(), f"check_split_kv_attention.py failed (rc {r.returncode}):\n{r.stderr[-4000:]}"
    d = json.loads(out.read_text())
    assert d["plans_equal"] == d["plans"] > 0, d["plan_differences"]
    assert d["split_plans"] > 0, d  # some calls were split: the plan was tested where it matters
    o = d["outputs"]
    merge = o[f"merge_{d['build_merge']}"]
    assert merge["matched"] == merge["total"] > 0, o
    # and the check could fail: without the split the rows differ somewhere, as with the other merge
    other = o["merge_mul_add" if d["build_merge"] == "fma" else "merge_fma"]
    assert o["not_split"]["matched"] < o["not_split"]["total"], o
    assert other["matched"] < other["total"], o
    assert r.returncode == 0 and d["ok"]
    return d


@pytest.mark.engine
def test_kv_split_is_vllms_split_kv_plan_and_merge(tmp_path):
    """The build this host runs, and vLLM's AVX2 build: natively on an AVX2 host, emulated on an AVX-512 one."""
    d = _check(tmp_path, [])
    if d["cpu_capability"].startswith("AVX512"):
        assert d["build_merge"] == "fma", d
        (tmp_path / "avx2").mkdir()
        d = _check(tmp_path / "avx2", [str(REPO / "scripts" / "emulate_cpu.sh"), "avx2"])
    assert not _host_has_avx512() or d["cpu_capability"] == "AVX2", d  # the AVX2 build was checked
    if d["cpu_capability"] == "AVX2":
        assert d["kernel_libraries"] == ["_C_AVX2.abi3.so"] and d["build_merge"] == "mul_add", d
