"""SGLang in the loop, the parts that need no engine: the sgl_kernel stand-in, how a failed engine run
is reported (cause and log file, no profile written), and the refusals of the SGLang commands."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engineloop import mismatch as mm
from engineloop.cli import app

REPO = Path(__file__).resolve().parents[2]
STANDIN = REPO / "scripts" / "sgl_kernel_standin"
cli = CliRunner()


# -- the stand-in ------------------------------------------------------------------------------------


def _in_python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(STANDIN))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_standin_holds_exactly_the_names_sglangs_cpu_engine_imports_and_each_refuses_to_run():
    r = _in_python("""
        import sgl_kernel
        print(sorted(sgl_kernel._NAMES))
        for n in sgl_kernel._NAMES:
            try:
                getattr(sgl_kernel, n)(1, 2)
            except NotImplementedError as e:
                assert n in str(e) and "stand-in" in str(e), e
            else:
                raise SystemExit(f"{n} ran")
        print(sgl_kernel.STANDIN)
    """)
    assert r.returncode == 0, r.stderr
    names = eval(r.stdout.splitlines()[0])  # noqa: S307 - our own subprocess's repr of a list of str
    assert names == sorted(["assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu",
                            "assign_req_to_token_pool_cpu", "build_tree_kernel_efficient_cpu",
                            "copy_all_layer_kv_cache_cpu", "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu",
                            "verify_tree_greedy_cpu"])
    assert "stand-in" in r.stdout


def test_a_name_the_standin_lacks_is_an_import_error_and_it_registers_no_torch_op():
    # SGLang's optional imports catch ImportError; its AMX check looks for this op and must find none
    # (else the engine would take its AMX kernels, which the stand-in does not have).
    r = _in_python("""
        import torch, sgl_kernel
        try:
            from sgl_kernel import fused_add_rmsnorm_cpu
        except ImportError as e:
            assert "stand-in" in str(e) or "cannot import" in str(e), e
        else:
            raise SystemExit("imported a name the stand-in does not have")
        assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_the_env_script_installs_the_standin_into_the_engines_venv_only():
    text = (REPO / "scripts" / "engine_env.sh").read_text()
    assert "install_sglang_standin" in text and 'sysconfig.get_paths()["purelib"]' in text
    # refuses a site-packages outside the venv (never the user's)
    assert '"$VENV"/*) ;;' in text


# -- a failed engine run: cause and log file -----------------------------------------------------------


def _fake_python(tmp_path: Path, body: str) -> Path:
    """An 'engine environment' whose python runs ``body`` (bash) instead of the capture."""
    venv = tmp_path / "fake-env"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text("#!/usr/bin/env bash\n" + body + "\n")
    py.chmod(py.stat().st_mode | stat.S_IXUSR)
    return venv


def _run(tmp_path: Path, venv: Path) -> mm.EngineRunFailed:
    with pytest.raises(mm.EngineRunFailed) as e:
        mm.run_capture("sglang", tmp_path / "model", tmp_path / "cap.pt", prompts=1, max_tokens=2, seed=0,
                       env=str(venv), note=lambda m: None)
    assert e.value.log is not None and e.value.log.is_file() and str(e.value.log) in str(e.value)
    return e.value


@pytest.mark.parametrize("body,cause,words", [
    ('echo "[capture] error: missing-standin: sgl_kernel is not installed" >&2; exit 3', "missing-standin",
     ["stand-in", "scripts/engine_env.sh sglang"]),
    ('echo "torch.distributed.DistNetworkError: ... name: EADDRINUSE, message: address already in use" >&2; exit 1',
     "port-in-use", ["port"]),
    ('echo "Traceback (most recent call last):" >&2; echo "RuntimeError: boom" >&2; kill -9 $$', "engine-crash",
     ["crashed", "signal 9", "RuntimeError: boom"]),
    ('echo "something odd" >&2; exit 5', "failed", ["exit 5", "something odd"]),
], ids=["missing-standin", "port-in-use", "crash", "other"])
def test_a_failed_engine_run_names_its_cause_and_keeps_its_log(tmp_path, body, cause, words):
    err = _run(tmp_path, _fake_python(tmp_path, body))
    assert err.cause == cause
    for w in words:
        assert w in str(err), (w, str(err))
    assert not (tmp_path / "cap.pt").exists()


def test_an_engine_run_past_the_timeout_is_stopped_with_every_process_it_started(tmp_path, monkeypatch):
    pidfile = tmp_path / "child.pid"
    # the "engine" starts a child (as SGLang starts its scheduler) and hangs
    venv = _fake_python(tmp_path, f'sleep 300 & echo $! > {pidfile}; echo "engine starting" >&2; wait')
    # 10 s: with 2 s the fake engine was sometimes stopped before it started its child on a loaded 2-core machine
    # (the engine tests run beside these)
    monkeypatch.setenv(mm.TIMEOUT_VAR, "10")
    err = _run(tmp_path, venv)
    assert err.cause == "timeout" and "10 s" in str(err) and mm.TIMEOUT_VAR in str(err)
    assert "engine starting" in err.log.read_text()
    child = int(pidfile.read_text())

    def alive() -> bool:
        try:
            os.kill(child, 0)
            return Path(f"/proc/{child}/stat").read_text().split()[2] != "Z"
        except (ProcessLookupError, FileNotFoundError):
            return False

    deadline = time.monotonic() + 5  # a signalled process takes a moment to exit on a loaded machine
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(), "the engine's child process outlived the timeout by 5 s"


def test_a_bad_timeout_setting_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(mm.TIMEOUT_VAR, "soon")
    with pytest.raises(mm.EngineProfilesError, match=mm.TIMEOUT_VAR):
        mm.run_capture("sglang", tmp_path, tmp_path / "c.pt", prompts=1, max_tokens=1, seed=0,
                       env=str(_fake_python(tmp_path, "exit 0")), note=lambda m: None)


def test_in_situ_with_an_engine_that_fails_writes_no_profile_and_says_why(tmp_path):
    venv = _fake_python(tmp_path, 'echo "[capture] error: missing-standin: no sgl_kernel" >&2; exit 3')
    out = tmp_path / "out"
    out.mkdir()
    r = cli.invoke(app, ["sglang", "--in-situ", "--family", "qwen2", "--env", str(venv), "-o", str(out)])
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert "missing-standin" in text and "engineprofiles-sglang-capture-" in text and ".log" in text
    assert list(out.iterdir()) == []


# -- refusals -------------------------------------------------------------------------------------------


def test_sglang_in_situ_and_mismatch_refuse_modes_the_cpu_engine_does_not_run(tmp_path):
    r = cli.invoke(app, ["sglang", "--in-situ", "--mode", "compiled", "-o", str(tmp_path)])
    assert r.exit_code == 2 and "default mode only" in " ".join(r.output.split()), r.output
    r = cli.invoke(app, ["mismatch", "sglang", "--mode", "eager"])
    assert r.exit_code == 2 and "default mode only" in " ".join(r.output.split()), r.output
    r = cli.invoke(app, ["mismatch", "tgi"])
    assert r.exit_code == 2 and "vllm or sglang" in r.output, r.output


def test_a_sglang_capture_decode_calls_become_one_attention_sample_each():
    import torch

    from engineloop.fit import attention_samples

    def call(t):
        return dict(q=torch.zeros(t, 2, 4), k=torch.ones(t, 1, 4), v=torch.ones(t, 1, 4), out=torch.zeros(t, 2, 4))

    seq = dict(layers=[call(5)], sample_calls=[[call(3), call(1), call(1)]])
    for per_call, decode_shapes in ((True, [(1, 4), (1, 5)]), (False, [(2, 5)])):
        cap = dict(engine=dict(attention=dict(scale=0.5, **({"decode_samples": "per_call"} if per_call else {}))),
                   sequences=[seq])
        got = [(s.q.shape[0], s.k.shape[0]) for s in attention_samples(cap) if s.path == "decode"]
        assert got == decode_shapes, (per_call, got)
