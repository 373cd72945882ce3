import pytest
from typer.testing import CliRunner

from engineloop.cli import app
from engineprofiles.store import ENV_VAR

runner = CliRunner()


@pytest.fixture
def shipped(tmp_path, monkeypatch, profile):
    d = tmp_path / "profiles"
    profile.save(d / f"{profile.canonical_name}.yaml")
    monkeypatch.setenv(ENV_VAR, str(d))
    return d, profile.canonical_name


def test_validate_accepts_a_good_profile_by_path_and_by_shipped_name(shipped):
    d, name = shipped
    r = runner.invoke(app, ["validate", str(d / f"{name}.yaml"), name])
    assert r.exit_code == 0, r.output
    assert r.output.count("ok") == 2


def test_validate_fails_with_the_reason_for_a_bad_profile(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("schema_version: 9\n")
    r = runner.invoke(app, ["validate", str(bad)])
    assert r.exit_code == 1
    assert "schema_version" in r.output and str(bad) in r.output


def test_show_prints_every_region_site_and_evidence(shipped):
    d, name = shipped
    r = runner.invoke(app, ["show", name], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    for word in ("rope", "cos_sin", "swiglu", "silu", "add_rmsnorm", "residual_out", "rmsnorm", "evidence", "100%"):
        assert word in r.output


def test_show_unknown_profile_lists_shipped_names_and_exits_2(shipped):
    d, name = shipped
    r = runner.invoke(app, ["show", "no-such-profile"])
    assert r.exit_code == 2
    assert "no-such-profile" in r.output and name in r.output


def test_list_shows_engine_version_backend_dtype(shipped):
    d, name = shipped
    r = runner.invoke(app, ["list"], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    for word in ("synthetic", "0.0", "cpu", "eager", "bfloat16"):
        assert word in r.output


def test_list_says_when_nothing_is_shipped(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    r = runner.invoke(app, ["list"])
    assert r.exit_code == 0 and "no shipped profiles" in r.output
