"""The kernels compile for an H100/H200 (sm_90) with Triton's real pipeline, on this CPU machine,
and the machine code keeps the portable semantics: no multiply-add contraction, no approximate
division/sqrt/reciprocal/exp, no flush-to-zero of subnormals. (What the interpreter tests prove
about the kernels' source holds for the GPU binary only if the compiler adds none of these.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def ptx_counts():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-m", "tests.emulator.ptx_check", "90"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_kernel_compiles_for_sm90_to_a_cubin(ptx_counts):
    names = {k.split("[")[0] for k in ptx_counts if not k.startswith("control")}
    assert names == {
        "_rope_fwd_kernel", "_rope_bwd_kernel", "_swiglu_fwd_kernel", "_swiglu_bwd_kernel", "_rmsnorm_fwd_kernel",
        "_rmsnorm_bwd_stats_kernel", "_rmsnorm_bwd_dx_kernel", "_sum_groups_kernel",
    }
    assert all(v["cubin_bytes"] > 0 for v in ptx_counts.values())


def test_gpu_code_has_no_contraction_approximation_or_flush_to_zero(ptx_counts):
    kernels = {k: v for k, v in ptx_counts.items() if not k.startswith("control")}
    bad = {k: v for k, v in kernels.items() if v["fma"] or v["approx"] or v["ftz"]}
    assert not bad, json.dumps(bad, indent=1)
    # The count can see contraction: the same RoPE kernel compiled with fusion on has FMAs.
    (control,) = [v for k, v in ptx_counts.items() if k.startswith("control")]
    assert control["fma"] > 0


def test_gpu_code_divides_and_takes_roots_correctly_rounded(ptx_counts):
    for k, v in ptx_counts.items():
        if k.startswith(("_swiglu", "_rmsnorm_fwd", "_rmsnorm_bwd_stats")):
            assert v["div_rn"] > 0, k
        if k.startswith(("_rmsnorm_fwd", "_rmsnorm_bwd_stats")):
            assert v["sqrt_rn"] > 0, k
