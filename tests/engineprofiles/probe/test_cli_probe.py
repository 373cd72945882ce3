"""probe-engine ENGINE: bad input fails early with a message that says what to do; the
transformers probe runs end to end (transformers is a test dependency)."""

import yaml
from typer.testing import CliRunner

from engineprofiles.cli import app
from engineprofiles.probe import runner as probe_runner

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
    monkeypatch.setattr(probe_runner, "make_adapter", lambda *a, **k: called.append(1))
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
