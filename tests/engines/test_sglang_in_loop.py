"""SGLang's real CPU engine in the loop: it starts with the project's sgl_kernel stand-in, the in-situ fit
reproduces the shipped in-situ profile, the trainer's log-probs equal the engine's where the profile says
they can, and a failed start says why and where its log is.

These need the environment made by `scripts/engine_env.sh sglang 0.5.23` (scripts/test.sh makes it).
A missing environment is a failure, never a skip. One engine run (a tiny Qwen2) serves the mismatch and
the in-situ fit: `mismatch --save-capture`, then `sglang --in-situ --capture`.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from engineprofiles.diff import diff_profiles
from engineprofiles.schema import load_profile
from engineprofiles.store import get_profile

from .envs import machine_differences

REPO = Path(__file__).resolve().parents[2]
VERSION = "0.5.23"
ENV = REPO / ".engines" / f"sglang-{VERSION}"


def _shipped_here() -> str:
    """The shipped in-situ profile exact mode chooses on this machine (its CPU capability first)."""
    from engineloop.mismatch import default_profile_name

    return default_profile_name("sglang", VERSION)


def _need_env() -> Path:
    if not (ENV / ".ready").exists():
        pytest.fail(f"the sglang {VERSION} environment is missing: run `scripts/engine_env.sh sglang {VERSION}` "
                    "(scripts/test.sh does this). Engine tests are not skipped.", pytrace=False)
    return ENV / "bin" / "python"


def _cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "engineloop.cli", *args], cwd=REPO, capture_output=True, text=True,
                       timeout=timeout, env=dict(os.environ))
    sys.stdout.write(r.stdout[-4000:])
    return r


@pytest.mark.engine
def test_sglang_engine_in_the_loop_matches_the_shipped_in_situ_profile_and_the_trainer(tmp_path):
    _need_env()
    cap, js = tmp_path / "cap.pt", tmp_path / "m.json"
    shipped = _shipped_here()
    old = get_profile(shipped)
    # Exact mode's claim holds on the machine the shipped profile was fitted on; elsewhere its rows are
    # computed with --allow-other-machine (measured, not claimed) and only the sites are compared. Where this
    # machine's attention fit is short of bitwise (SGLang's torch_native attention on AVX2: torch's 8-lane softmax
    # is not in the attention lattice), exact mode must refuse, before the engine runs; the profile rows still run.
    other = machine_differences(shipped)
    exact = not other and old.attention.evidence.match_rate == 1.0
    if not other and not exact:
        r = _cli("mismatch", "sglang", "--family", "qwen2", "--exact", "--profile", shipped, "--prompts", "2")
        said = " ".join(r.stderr.split())
        assert r.returncode == 2 and "matched the engine on" in said and "refuses" in said, r.stderr[-4000:]
        assert "Traceback" not in said, r.stderr[-4000:]
        warnings.warn(f"{shipped}: attention fitted to {old.attention.evidence.match_rate:.4%}, not bitwise: exact "
                      "mode refused, as it must", stacklevel=1)
    r = _cli("mismatch", "sglang", "--family", "qwen2", *(["--exact"] if exact or other else []), "--prompts", "2",
             "--json", str(js), "--save-capture", str(cap), *(["--allow-other-machine"] if other else []))
    assert r.returncode == 0, f"probe-engine mismatch sglang failed (rc {r.returncode}):\n{r.stderr[-4000:]}"
    d = json.loads(js.read_text())
    assert d["engine"]["name"] == "sglang" and d["engine"]["version"] == VERSION
    assert d["engine"]["settings"]["attention_backend"] == "torch_native"
    assert "stand-in" in d["engine"]["settings"]["sgl_kernel"]
    rows = {k: {x["trainer"]: x for x in d[k]} for k in ("sampled", "prefill")}

    out = tmp_path / "insitu.yaml"
    r = _cli("sglang", "--in-situ", "--family", "qwen2", "--capture", str(cap), "-o", str(out))
    assert r.returncode == 0, f"probe-engine sglang --in-situ failed (rc {r.returncode}):\n{r.stderr[-4000:]}"
    new = load_profile(out)
    assert new.provenance.method == "in-situ" and (new.canonical_name == shipped or other), (new.canonical_name,
                                                                                            shipped)
    dd = diff_profiles(old, new, shipped, "fitted now")
    assert dd.exit_code == 0, dd.to_markdown()
    assert new.point("attention") == old.point("attention"), (new.point("attention"), old.point("attention"))
    if not other and not exact:  # the fit here is as short of bitwise as the shipped one
        assert new.attention.evidence.match_rate < 1.0, new.attention.evidence
        for region in ("rope", "swiglu", "add_rmsnorm", "rmsnorm"):
            assert new.entry(region).evidence.match_rate == 1.0, region
        assert rows["prefill"]["as-is"]["exact_match"] < rows["prefill"]["+ engine profile"]["exact_match"]
        return

    if exact:
        # every captured tensor and attention output bit for bit, as the shipped evidence says
        for region in ("rope", "swiglu", "add_rmsnorm", "rmsnorm"):
            assert new.entry(region).evidence.match_rate == 1.0, region
        assert new.attention.evidence.match_rate == 1.0
        best = rows["prefill"]["exact, engine's log-prob formula"]
        assert best["exact_match"] == 1.0 and best["abs_dlogp_max"] == 0.0, best
        # with log_softmax (the trainer's own) a few tokens differ by an FP32 ulp or so, never more
        assert rows["prefill"]["exact"]["abs_dlogp_max"] < 1e-6, rows["prefill"]["exact"]
        assert rows["prefill"]["as-is"]["exact_match"] < rows["prefill"]["+ engine profile"]["exact_match"]
        # The rollout's own log-probs: the completion decoded as the engine decoded it, through its sampler's
        # log(softmax(x)); the one-prefill re-score matches none of them (SGLang's decode is not its prefill).
        rollout = rows["sampled"]["exact, decoded, engine's log-prob formula"]
        assert rollout["exact_match"] == 1.0 and rollout["abs_dlogp_max"] == 0.0, rollout
        assert rows["sampled"]["exact"]["exact_match"] < 1.0
    else:
        warnings.warn(f"SGLang ran on another machine than the shipped in-situ profile was fitted on ({other}): sites "
                      f"compared, rates not (attention {new.attention.evidence.match_rate})", stacklevel=1)
    # The engine's sampler takes log(softmax): its decode log-probs are not its prefill ones; said so.
    assert d["engine_decode_equals_prefill"] is not None
    if d["engine_decode_equals_prefill"] < 1.0:
        assert any("SGLang's sampler" in w for w in d["warnings"]), d["warnings"]


def _capture(python: Path, model: Path, tmp_path: Path, env: dict | None = None):
    from engineloop import mismatch as mm

    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        with pytest.raises(mm.EngineRunFailed) as e:
            mm.run_capture("sglang", model, tmp_path / "cap.pt", prompts=1, max_tokens=2, seed=0,
                           env=str(python), note=lambda m: None)
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert e.value.log is not None and e.value.log.is_file() and str(e.value.log) in str(e.value)
    assert not (tmp_path / "cap.pt").exists()
    return e.value


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    from engineloop.mismatch import save_model
    from engineprofiles.models import tiny_model

    d = tmp_path_factory.mktemp("model") / "tiny-qwen2"
    save_model(tiny_model("qwen2"), d)
    return d


@pytest.mark.engine
def test_sglang_start_with_its_port_in_use_names_the_port(tmp_path, tiny_qwen2):
    python = _need_env()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        err = _capture(python, tiny_qwen2, tmp_path, {"ENGINEPROFILES_SGLANG_NCCL_PORT": str(s.getsockname()[1])})
    finally:
        s.close()
    assert err.cause == "port-in-use", str(err)


@pytest.mark.engine
def test_sglang_without_the_standin_says_to_make_the_environment(tmp_path, tiny_qwen2):
    python = _need_env()
    # the engine's own python, with sgl_kernel hidden (as in an environment made before the stand-in)
    venv = tmp_path / "env"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text(f"#!/usr/bin/env bash\nexec {python} -c 'import sys, runpy; sys.modules[\"sgl_kernel\"] = None; "
                  "sys.argv = sys.argv[2:]; runpy.run_module(\"engineloop.capture\", run_name=\"__main__\")' \"$@\"\n")
    py.chmod(py.stat().st_mode | stat.S_IXUSR)
    err = _capture(py, tiny_qwen2, tmp_path)
    assert err.cause == "missing-standin" and "scripts/engine_env.sh sglang" in str(err), str(err)


@pytest.mark.engine
def test_sglang_crash_on_a_broken_model_is_reported_as_a_crash(tmp_path, tiny_qwen2):
    import shutil

    python = _need_env()
    broken = tmp_path / "broken"
    shutil.copytree(tiny_qwen2, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    err = _capture(python, broken, tmp_path)
    assert err.cause == "engine-crash", str(err)
