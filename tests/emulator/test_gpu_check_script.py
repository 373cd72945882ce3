"""scripts/gpu_check.py is ready for a GPU: its checks and benchmarks run end to end on the CPU
through the Triton interpreter (--smoke), and it refuses politely where there is no GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _run(*args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_gpu_check_smoke_run_checks_bits_and_benchmarks_every_region(tmp_path):
    out = tmp_path / "gpu_check.json"
    res = _run("--smoke", "--out", str(out))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["bitexact_passed"] > 50 and data["bitexact_failed"] == []
    seen = {(r["region"], r["impl"]) for r in data["bench"]}
    for region in ("rmsnorm", "add_rmsnorm", "swiglu", "rope"):
        assert {(region, "emulator"), (region, "hf")} <= seen
    assert "emulator / hf" in res.stdout


def test_gpu_check_without_a_gpu_says_so():
    res = _run("--skip-bench")
    assert res.returncode == 2
    assert "no CUDA device" in res.stdout
