"""`probe-engine check` against the real vLLM 0.32.0 (its op-level profile), run as a user runs it:
from the project's environment, handing over to the engine's (ENGINEPROFILES_ENGINES, else the
checkout's .engines/). One vLLM probe per run (two where the shipped profile is of another CPU capability: the regions only).

The shipped profile was probed on AVX512. Where this machine's CPU capability is the profile's, it is
the reference; elsewhere the profile's evidence belongs to another code path, so a profile is probed
here first and is the reference instead. The reference and a doctored copy (swiglu's silu site
flipped) are checked in one run (one probe): exit 1, the reference agreeing (its exit code 0), the copy
differing in exactly that site. (The text form of the verdict is tests/engineloop/test_check.py's.)
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from engineprofiles.store import shipped_dir

from .envs import REGIONS_ONLY

REPO = Path(__file__).resolve().parents[2]
SHIPPED = "vllm-0.32.0-cpu-inductor-bfloat16"


def _engines() -> Path:
    return Path(os.environ.get("ENGINEPROFILES_ENGINES") or REPO / ".engines")


def _run(args: list[str], python: str = sys.executable, **env: str) -> subprocess.CompletedProcess:
    e = dict(os.environ, COLUMNS="200", ENGINEPROFILES_ENGINES=str(_engines()))
    e.pop("ENGINEPROFILES_REEXEC", None)
    e.update(env)
    r = subprocess.run([python, "-m", "engineloop.cli", *args], cwd=REPO, env=e, capture_output=True, text=True,
                       timeout=900)
    sys.stdout.write(r.stdout[-4000:])
    sys.stdout.write(r.stderr[-3000:])
    return r


@pytest.mark.engine
def test_check_vllm_against_its_op_level_profile_and_a_doctored_copy(tmp_path, op_level_probe):
    python = _engines() / "vllm-0.32.0" / "bin" / "python"
    if not (python.exists() and (python.parent.parent / ".ready").exists()):
        pytest.fail(f"the vllm 0.32.0 environment is missing in {_engines()}: run `scripts/engine_env.sh vllm 0.32.0` "
                    "(scripts/test.sh does this). Engine tests are not skipped.", pytrace=False)
    cap = subprocess.run([str(python), "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                         capture_output=True, text=True, check=True).stdout.strip()
    shipped = yaml.safe_load((shipped_dir() / f"{SHIPPED}.yaml").read_text())
    if cap == shipped["engine"]["settings"]["cpu_capability"]:
        reference, data = SHIPPED, shipped
    else:  # probed here, on this machine's code path (the session's op-level probe of the regions, shared with
        # test_real_engines, which makes no claim on another ISA either: the check is then of the regions only)
        r, fresh = op_level_probe("vllm", "0.32.0", *REGIONS_ONLY)
        assert r.returncode == 0, r.stderr[-4000:]
        reference, data = str(fresh), yaml.safe_load(fresh.read_text())
    sites = data["regions"]["swiglu"]["sites"]
    was = sites["silu"]
    sites["silu"] = {"fp32": "rounded", "rounded": "fp32"}[was]
    bad = tmp_path / "doctored.yaml"
    bad.write_text(yaml.safe_dump(data, sort_keys=False))

    r = _run(["check", reference, str(bad), "-f", "json"])
    assert r.returncode == 1, r.stderr[-4000:]
    assert "running in the vllm-0.32.0 environment" in r.stderr and "swiglu: probing" in r.stderr
    out = json.loads(r.stdout)
    assert out["installed_version"] == "0.32.0"
    ok, drift = out["profiles"]
    assert (ok["exit_code"], ok["points_agree"], ok["differences"]) == (0, True, [])
    assert drift["exit_code"] == 1
    assert drift["differences"] == [dict(region="swiglu", name="silu", kind="site", profile=sites["silu"], now=was)]
