"""probe-engine ENGINE: bad input fails early with a message that says what to do; the
transformers probe runs end to end (transformers is a test dependency)."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from engineloop.cli import app
from engineloop import runner as probe_runner
from engineprofiles.schema import SCHEMA_VERSION

cli = CliRunner()


def test_engine_not_installed_names_the_script_that_installs_it(tmp_path, monkeypatch):
    monkeypatch.setattr(probe_runner, "ENGINES_DIR", tmp_path)
    monkeypatch.setattr(probe_runner, "engine_importable", lambda e: False)
    monkeypatch.delenv("ENGINEPROFILES_REEXEC", raising=False)
    for engine, script in (("vllm", "scripts/engine_env.sh vllm"), ("sglang", "scripts/engine_env.sh sglang")):
        r = cli.invoke(app, [engine, "-o", str(tmp_path)])
        assert r.exit_code == 2, r.output
        assert script in r.output and "not installed" in r.output


def test_outside_a_checkout_no_engine_environment_says_where_it_looked_and_how_to_point_elsewhere(tmp_path, monkeypatch):
    # An installed wheel: the package's parent is site-packages, with no scripts/engine_env.sh.
    monkeypatch.setattr(probe_runner, "REPO", tmp_path)
    monkeypatch.setattr(probe_runner, "ENGINES_DIR", tmp_path / ".engines")
    monkeypatch.delenv("ENGINEPROFILES_ENGINES", raising=False)
    with pytest.raises(probe_runner.EngineNotInstalled) as e:
        probe_runner.find_engine_python("vllm")
    msg = str(e.value)
    for words in (f"looked for {tmp_path / '.engines' / 'vllm'}-VERSION/", "not a checkout",
                  "set ENGINEPROFILES_ENGINES", "scripts/engine_env.sh vllm", "--env"):
        assert words in msg, (words, msg)


def test_output_under_a_file_fails_before_probing(tmp_path, monkeypatch):
    # An output that cannot be written (even by root: a path below a regular file) is refused
    # before the engine is loaded.
    f = tmp_path / "file"
    f.write_text("x")
    called = []
    monkeypatch.setattr("engineprofiles.probe.adapters.make_adapter", lambda *a, **k: called.append(1))
    r = cli.invoke(app, ["transformers", "-o", str(f / "sub" / "x.yaml")])
    assert r.exit_code == 2 and "cannot write" in r.output and not called


def test_unknown_dtype_and_region_are_refused(tmp_path):
    r = cli.invoke(app, ["transformers", "--dtype", "fp8", "-o", str(tmp_path)])
    assert r.exit_code == 2 and "fp8" in r.output
    r = cli.invoke(app, ["transformers", "--region", "mlp", "-o", str(tmp_path)])
    assert r.exit_code == 2 and "mlp" in r.output and "moe" in r.output  # the message lists what --region takes


def test_region_moe_probes_the_moe_experts_alone(tmp_path):
    r = cli.invoke(app, ["transformers", "--quick", "--region", "moe", "-o", str(tmp_path)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    from engineprofiles.schema import load_profile

    prof = load_profile(next(tmp_path.glob("*.yaml")))
    assert prof.available("moe") and prof.moe.evidence.match_rate == 1.0
    assert prof.point("moe")["gate_up"] == "rounded"  # HF's experts: BF16 GEMMs
    assert not prof.available("swiglu") and not prof.available("attention")


def test_transformers_probe_writes_the_hf_profile(tmp_path):
    r = cli.invoke(app, ["transformers", "--quick", "-o", str(tmp_path)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    files = list(tmp_path.glob("transformers-*-cpu-eager-bfloat16*.yaml"))  # -avx2 where torch runs AVX2
    assert len(files) == 1
    data = yaml.safe_load(files[0].read_text())
    assert data["regions"]["swiglu"]["sites"] == {"silu": "rounded"}
    assert data["regions"]["rope"]["sites"] == {"cos_sin": "rounded", "products": "rounded"}
    assert data["regions"]["add_rmsnorm"]["sites"] == {
        "variance_input": "rounded", "normalize_input": "rounded", "normalized": "rounded", "residual_out": "rounded"}
    assert data["provenance"]["method"] == "op-level"
    assert "rounding sites" in r.output


def test_bad_arguments_are_refused_before_handing_over_to_an_engine_environment(tmp_path, monkeypatch):
    # Checked in this process (no torch, no engine): the message is about the argument, not
    # about a missing engine environment.
    monkeypatch.setattr(probe_runner, "ENGINES_DIR", tmp_path)
    monkeypatch.setattr(probe_runner, "engine_importable", lambda e: False)
    monkeypatch.delenv("ENGINEPROFILES_REEXEC", raising=False)
    r = cli.invoke(app, ["vllm", "--op-level", "--dtype", "fp8", "-o", str(tmp_path)])
    assert r.exit_code == 2 and "fp8" in r.output and "not installed" not in r.output
    r = cli.invoke(app, ["vllm", "--op-level", "--region", "mlp", "-o", str(tmp_path)])
    assert r.exit_code == 2 and "mlp" in r.output and "not installed" not in r.output


def test_region_names_agree_with_the_region_specs():
    from engineprofiles.names import BESIDE_NAMES, REGION_NAMES
    from engineprofiles.regions import BESIDE, REGIONS

    assert REGION_NAMES == tuple(REGIONS)
    assert BESIDE_NAMES == tuple(BESIDE)  # --region checks these names without loading torch


def test_the_process_that_hands_over_does_not_load_torch():
    code = ("import sys, engineloop.cli, engineloop.runner, engineprofiles.store; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_module_entry_point_writes_and_flushes_everything_before_its_fast_exit(tmp_path):
    # `python -m engineloop.cli` (how probe-engine runs in an engine environment) skips the
    # interpreter's teardown after a probe: the profile and all output must be complete by then.
    env = dict(os.environ, COLUMNS="200", ENGINEPROFILES_REEXEC="1")
    out = tmp_path / "p.yaml"
    r = subprocess.run([sys.executable, "-m", "engineloop.cli", "transformers", "--quick", "-o", str(out), "--yaml"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert "rounding sites" in r.stdout
    printed = yaml.safe_load(r.stdout[r.stdout.index("schema_version:"):])  # the YAML, printed last
    assert printed == yaml.safe_load(out.read_text())
    assert "wrote" in r.stderr
    assert yaml.safe_load(out.read_text())["regions"]["swiglu"]["sites"] == {"silu": "rounded"}
    # errors and other commands end the normal way, with their exit codes
    r = subprocess.run([sys.executable, "-m", "engineloop.cli", "transformers", "--dtype", "fp8", "-o", str(out)],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "fp8" in r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("schema_version: 9\n")
    r = subprocess.run([sys.executable, "-m", "engineloop.cli", "validate", str(bad)], capture_output=True, text=True)
    assert r.returncode == 1 and "schema_version" in r.stderr


# -- hostile input (issue 17) ----------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
QUICK = ["--quick", "--region", "swiglu"]


def _no_probe(monkeypatch):
    """Record whether a probe started (it must not, when the arguments are refused)."""
    called = []
    monkeypatch.setattr("engineprofiles.probe.adapters.make_adapter", lambda *a, **k: called.append(1))
    monkeypatch.setattr("engineloop.cli._patched_adapter", lambda *a, **k: called.append(1))
    return called


def _refused(r, *words):
    assert r.exit_code == 2, (r.output, r.exception)
    assert isinstance(r.exception, SystemExit), r.exception  # an error: line, not a traceback
    assert "error:" in r.output, r.output
    said = " ".join(r.output.split())  # rich wraps long lines
    for w in words:
        assert w in said, (w, r.output)


def test_output_to_a_fifo_is_refused_before_probing_and_stays_a_fifo(tmp_path, monkeypatch):
    called = _no_probe(monkeypatch)
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    _refused(cli.invoke(app, ["transformers", "--quick", "-o", str(fifo)]), "not a regular file", "-o -")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and not called


@pytest.mark.parametrize("dev", ["/dev/null", "/dev/full"])
def test_output_to_a_device_is_refused_before_probing_and_stays_a_device(dev, monkeypatch):
    called = _no_probe(monkeypatch)
    before = os.lstat(dev)
    _refused(cli.invoke(app, ["transformers", "--quick", "-o", dev]), "not a regular file")
    after = os.lstat(dev)
    assert stat.S_ISCHR(after.st_mode) and (after.st_rdev, after.st_mode) == (before.st_rdev, before.st_mode)
    assert not called


def test_output_in_proc_is_refused_before_probing(monkeypatch):
    # Root passes os.access checks there; creating a file does not.
    called = _no_probe(monkeypatch)
    _refused(cli.invoke(app, ["transformers", "--quick", "-o", "/proc/engineprofiles-x.yaml"]), "cannot write")
    assert not called


def _canonical_transformers_name():
    """The name the transformers probe gives its profile here (schema.Profile.canonical_name: the CPU capability
    in lower case where it is not AVX512)."""
    import torch
    import transformers

    cap = torch.backends.cpu.get_cpu_capability()
    return f"transformers-{transformers.__version__}-cpu-eager-bfloat16" + ("" if cap == "AVX512" else f"-{cap.lower()}")


def test_a_fifo_in_the_output_folder_with_the_profiles_name_is_refused_and_stays(tmp_path):
    fifo = tmp_path / f"{_canonical_transformers_name()}.yaml"
    os.mkfifo(fifo)
    _refused(cli.invoke(app, ["transformers", *QUICK, "-o", str(tmp_path)]), "not a regular file")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert [p.name for p in tmp_path.iterdir()] == [fifo.name]


@pytest.mark.parametrize("mode", [0o644, 0o640])
def test_a_profile_written_over_a_file_keeps_its_mode(tmp_path, mode):
    out = tmp_path / "p.yaml"
    out.write_text("old\n")
    os.chmod(out, mode)
    r = cli.invoke(app, ["transformers", *QUICK, "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert os.stat(out).st_mode & 0o7777 == mode and yaml.safe_load(out.read_text())["schema_version"] == SCHEMA_VERSION


def test_a_new_profile_honours_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        r = cli.invoke(app, ["transformers", *QUICK, "-o", str(tmp_path / "p.yaml")])
    finally:
        os.umask(old)
    assert r.exit_code == 0, r.output
    assert os.stat(tmp_path / "p.yaml").st_mode & 0o777 == 0o644


def test_dash_output_prints_the_yaml_alone_on_stdout(tmp_path):
    r = cli.invoke(app, ["transformers", *QUICK, "-o", "-"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    data = yaml.safe_load(r.stdout)
    assert data["regions"]["swiglu"]["sites"] == {"silu": "rounded"}
    assert "rounding sites" in r.stderr and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["folder", "file"])
def test_the_checkouts_profiles_folder_is_refused_without_ship(where, monkeypatch):
    called = _no_probe(monkeypatch)
    shipped = sorted((REPO / "profiles").glob("*.yaml"))
    target = str(REPO / "profiles") + os.sep if where == "folder" else str(shipped[0])
    _refused(cli.invoke(app, ["transformers", "--quick", "-o", target]), "--ship")
    _refused(cli.invoke(app, ["vllm", "--op-level", "--quick", "-o", target]), "--ship")
    assert not called


def test_ship_allows_writing_into_the_shipped_folder(tmp_path, monkeypatch):
    from engineprofiles.store import ENV_VAR

    d = tmp_path / "profiles"
    d.mkdir()
    monkeypatch.setenv(ENV_VAR, str(d))
    _refused(cli.invoke(app, ["transformers", *QUICK, "-o", str(d)]), "--ship")
    assert list(d.iterdir()) == []
    r = cli.invoke(app, ["transformers", *QUICK, "-o", str(d), "--ship"])
    assert r.exit_code == 0, r.output
    assert [p.name for p in d.iterdir()] == [f"{_canonical_transformers_name()}.yaml"]


@pytest.mark.parametrize("args, word", [
    (["--family", "gpt2"], "gpt2"), (["--mode", "turbo"], "turbo"), (["--device", "tpu"], "tpu"),
    (["--device", "cuda:x"], "cuda:x"),
])
def test_bad_transformers_options_are_error_lines(tmp_path, monkeypatch, args, word):
    called = _no_probe(monkeypatch)
    _refused(cli.invoke(app, ["transformers", "--quick", *args, "-o", str(tmp_path)]), word)
    assert not called


@pytest.mark.parametrize("engine, args, word", [
    ("vllm", ["--op-level", "--mode", "turbo"], "turbo"), ("vllm", ["--op-level", "--device", "tpu"], "tpu"),
    ("vllm", ["--mode", "turbo"], "turbo"), ("vllm", ["--in-situ", "--family", "gpt2"], "gpt2"),
    ("vllm", ["--in-situ", "--rope-scaling", "ntk"], "unknown RoPE scaling 'ntk'"),
    ("vllm", ["--op-level", "--rope-scaling", "llama3"], "--rope-scaling are in-situ options"),
    ("vllm", ["--op-level", "--no-self-check"], "--self-check/--no-self-check and --rope-scaling are in-situ"),
    ("sglang", ["--mode", "eager"], "eager"), ("sglang", ["--device", "tpu"], "tpu"),
])
def test_bad_engine_options_are_refused_before_handing_over(tmp_path, monkeypatch, engine, args, word):
    monkeypatch.setattr(probe_runner, "ENGINES_DIR", tmp_path)
    monkeypatch.setattr(probe_runner, "engine_importable", lambda e: False)
    monkeypatch.delenv("ENGINEPROFILES_REEXEC", raising=False)
    r = cli.invoke(app, [engine, *args, "-o", str(tmp_path)])
    _refused(r, word)
    assert "not installed" not in r.output


def test_cuda_without_a_cuda_device_is_an_error_line(tmp_path, monkeypatch):
    import torch

    called = _no_probe(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _refused(cli.invoke(app, ["transformers", "--quick", "--device", "cuda", "-o", str(tmp_path)]), "CUDA")
    assert not called


def test_env_pointing_at_a_file_that_is_not_executable_is_an_error_line(tmp_path, monkeypatch):
    monkeypatch.setattr(probe_runner, "engine_importable", lambda e: False)
    monkeypatch.delenv("ENGINEPROFILES_REEXEC", raising=False)
    py = tmp_path / "python"
    py.write_text("not a program\n")
    os.chmod(py, 0o644)
    _refused(cli.invoke(app, ["vllm", "--op-level", "--env", str(py), "-o", str(tmp_path)]), "not executable")
    _refused(cli.invoke(app, ["vllm", "--env", str(py), "-o", str(tmp_path)]), "not executable")  # in situ


def test_env_pointing_at_a_program_that_fails_silently_is_an_error_line(tmp_path, monkeypatch):
    monkeypatch.setattr(probe_runner, "engine_importable", lambda e: False)
    monkeypatch.delenv("ENGINEPROFILES_REEXEC", raising=False)
    false = "/bin/false" if os.path.exists("/bin/false") else "/usr/bin/false"
    _refused(cli.invoke(app, ["vllm", "--op-level", "--env", false, "-o", str(tmp_path)]), false, "status 1")
    _refused(cli.invoke(app, ["vllm", "--env", false, "-o", str(tmp_path)]), false, "exit 1")  # in situ


def test_vllm_in_float16_says_it_probes_op_level_because_in_situ_is_bfloat16_only(tmp_path, monkeypatch):
    # --dtype float16 cannot run in situ (the capture runs vLLM's CPU build in bfloat16): the
    # command says so before handing over, and the engine environment is what is missing here.
    monkeypatch.setattr(probe_runner, "ENGINES_DIR", tmp_path)
    monkeypatch.setattr(probe_runner, "engine_importable", lambda e: False)
    monkeypatch.delenv("ENGINEPROFILES_REEXEC", raising=False)
    r = cli.invoke(app, ["vllm", "--dtype", "float16", "-o", str(tmp_path)])
    assert "probing op-level" in r.output and "bfloat16 only" in r.output
    r = cli.invoke(app, ["vllm", "--in-situ", "--dtype", "float16", "-o", str(tmp_path)])
    assert r.exit_code == 2 and "bfloat16 only" in r.output
