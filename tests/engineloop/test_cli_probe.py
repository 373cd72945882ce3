"""probe-engine ENGINE: bad input fails early with a message that says what to do; the
transformers probe runs end to end (transformers is a test dependency)."""

import os
import subprocess
import sys

import yaml
from typer.testing import CliRunner

from engineloop.cli import app
from engineloop import runner as probe_runner

cli = CliRunner()


def test_engine_not_installed_names_the_script_that_installs_it(tmp_path, monkeypatch):
    monkeypatch.setattr(probe_runner, "ENGINES_DIR", tmp_path)
    monkeypatch.setattr(probe_runner, "engine_importable", lambda e: False)
    monkeypatch.delenv("ENGINEPROFILES_REEXEC", raising=False)
    for engine, script in (("vllm", "scripts/engine_env.sh vllm"), ("sglang", "scripts/engine_env.sh sglang")):
        r = cli.invoke(app, [engine, "-o", str(tmp_path)])
        assert r.exit_code == 2, r.output
        assert script in r.output and "not installed" in r.output


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
    r = cli.invoke(app, ["transformers", "--region", "attention", "-o", str(tmp_path)])
    assert r.exit_code == 2 and "attention" in r.output


def test_transformers_probe_writes_the_hf_profile(tmp_path):
    r = cli.invoke(app, ["transformers", "--quick", "-o", str(tmp_path)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    files = list(tmp_path.glob("transformers-*-cpu-eager-bfloat16.yaml"))
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
    r = cli.invoke(app, ["vllm", "--op-level", "--region", "attention", "-o", str(tmp_path)])
    assert r.exit_code == 2 and "attention" in r.output and "not installed" not in r.output


def test_region_names_agree_with_the_region_specs():
    from engineprofiles.names import REGION_NAMES
    from engineprofiles.regions import REGIONS

    assert REGION_NAMES == tuple(REGIONS)


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
