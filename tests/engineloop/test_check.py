"""probe-engine check: what it re-probes for a profile, how it compares, its exit codes and
messages. The probe is replaced by a function that returns a given profile (no engine runs here),
except in the last test, which checks the shipped transformers profile for real (transformers is
a test dependency; ~3 s). tests/engines/test_check_engine.py runs it against vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from engineloop import check as chk
from engineloop import runner as probe_runner
from engineloop.cli import app
from engineprofiles import store
from engineprofiles.schema import load_profile, profile_from_data

from ..conftest import as_schema_version, synthetic_profile

cli = CliRunner()
VLLM = "vllm-0.32.0-cpu-inductor-bfloat16"
NOT_PROBED = {"sites": None, "evidence": {"status": "unavailable", "reason": "not probed in this run (--region)"}}


def shipped_data(name: str = VLLM) -> dict:
    return yaml.safe_load((store.shipped_dir() / f"{name}.yaml").read_text())


def write(tmp_path: Path, data: dict, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def doctored(data: dict, region: str = "swiglu", site: str = "silu") -> dict:
    """``data`` with one site of one region flipped (fp32 <-> rounded)."""
    sites = data["regions"][region]["sites"] if region != "attention" else data["attention"]["sites"]
    sites[site] = {"fp32": "rounded", "rounded": "fp32"}[sites[site]]
    return data


@pytest.fixture
def engine_here(monkeypatch, tmp_path):
    """vLLM 0.32.0 "installed" in this process (and no engine environments to hand over to);
    ``probed`` is what the probe returns (default: the shipped profile itself); ``calls`` records
    each probe's plan."""
    state = {"probed": load_profile(store.shipped_dir() / f"{VLLM}.yaml"), "calls": [], "version": "0.32.0"}
    monkeypatch.setattr(probe_runner, "ENGINES_DIR", tmp_path / "no-engines")
    monkeypatch.setattr(probe_runner, "reexec_in", lambda *a, **k: pytest.fail("handed over to an engine environment"))
    monkeypatch.setattr(probe_runner, "engine_importable", lambda e: True)
    monkeypatch.setattr(store, "installed_version", lambda e: state["version"])
    monkeypatch.delenv("ENGINEPROFILES_REEXEC", raising=False)

    def fake_reprobe(plan, progress):
        state["calls"].append(plan)
        progress("probing (fake)")
        return state["probed"]

    monkeypatch.setattr(chk, "reprobe", fake_reprobe)
    return state


def run(*args: str):
    return cli.invoke(app, ["check", *args], env={"COLUMNS": "200"})


# -- what is re-probed ------------------------------------------------------------------------------


@pytest.mark.parametrize("name,engine,mode,family", [
    (VLLM, "vllm", "compiled", None),
    ("vllm-0.32.0-cpu-eager-bfloat16", "vllm", "eager", None),
    ("sglang-0.5.23-cpu-eager-bfloat16", "sglang", "default", None),
    ("transformers-5.19.0-cpu-eager-bfloat16", "transformers", "default", "qwen2"),
])
def test_the_plan_is_read_from_the_profile(name, engine, mode, family):
    p = store.get_profile(name)
    plan = chk.plan_for(p, name)
    assert (plan.engine, plan.version, plan.mode, plan.family) == (engine, p.engine.version, mode, family)
    assert (plan.dtype, plan.device, plan.seed, plan.quick, plan.regions) == ("bfloat16", "cpu", 0, False, None)


def test_the_plan_keeps_the_seed_the_quick_sweep_and_the_regions_probed(tmp_path):
    data = shipped_data()
    data["provenance"].update(seed=7, command="probe-engine vllm --op-level --quick --region rope -o x")
    data["regions"]["swiglu"] = NOT_PROBED
    data["attention"] = NOT_PROBED
    plan = chk.plan_for(load_profile(write(tmp_path, data)), "p")
    assert (plan.seed, plan.quick, plan.regions) == (7, True, ("rope", "add_rmsnorm", "rmsnorm", "moe", "shared_expert"))


@pytest.mark.parametrize("what,words", [
    ("in-situ", ["fitted in situ", "op-level profile its fit starts from (vllm-0.32.0-cpu-inductor-bfloat16)",
                 "probe-engine vllm --in-situ"]),
    ("synthetic", ["synthetic profile", "nothing to re-probe"]),
    ("patched", ["'patched'", "--apply"]),
    ("rocm", ["backend rocm"]),
    ("nothing", ["nothing to compare"]),
])
def test_profiles_that_cannot_be_rechecked_are_refused_with_what_to_do(tmp_path, what, words):
    data = shipped_data()
    if what == "in-situ":
        data = shipped_data(VLLM + "-insitu")
    elif what == "synthetic":
        data = json.loads(synthetic_profile().model_dump_json())
    elif what == "patched":
        data = shipped_data("transformers-5.19.0-cpu-eager-bfloat16")
        data["engine"]["execution_mode"] = "patched"
    elif what == "rocm":
        data["engine"]["backend"] = "rocm"
    else:
        data["regions"] = {r: NOT_PROBED for r in data["regions"]}
        data["attention"] = data["moe"] = data["shared_expert"] = NOT_PROBED
    with pytest.raises(chk.CheckRefused) as e:
        chk.plan_for(profile_from_data(data), "p")
    for w in words:
        assert w in str(e.value), (w, str(e.value))


# -- comparison and exit codes ------------------------------------------------------------------------


def test_the_engine_rounding_as_the_profile_says_exits_0(engine_here):
    r = run(VLLM)
    assert r.exit_code == 0, r.output
    assert f"ok: {VLLM}: the installed engine rounds as the profile says" in r.output
    assert "rope, swiglu, add_rmsnorm, rmsnorm, attention" in r.output
    assert len(engine_here["calls"]) == 1 and engine_here["calls"][0].mode == "compiled"


def test_a_doctored_profile_exits_1_with_the_diff(engine_here, tmp_path):
    path = write(tmp_path, doctored(shipped_data()))
    r = run(str(path))
    assert r.exit_code == 1, r.output
    assert "drift:" in r.output and "swiglu.silu: rounded -> fp32" in r.output
    assert "differs" in r.output  # the diff table marks the row


@pytest.mark.parametrize("edit,words", [
    (lambda d: d["regions"]["rope"]["variants"].update(fma="cos"), "rope.fma: cos -> none"),
    (lambda d: d["attention"]["variants"].update(row_sum="sequential"),
     "attention.row_sum: sequential -> lanes16_tree"),
    (lambda d: doctored(d, "attention", "probs"), "attention.probs: rounded -> fp32"),
    (lambda d: d["regions"].update(rmsnorm={"sites": None, "evidence": {"status": "unavailable", "reason": "no kernel"}}),
     "rmsnorm: unavailable (no kernel) -> available"),
])
def test_a_variant_attention_or_availability_difference_is_drift_too(engine_here, tmp_path, edit, words):
    data = shipped_data()
    edit(data)
    r = run(str(write(tmp_path, data)))
    assert r.exit_code == 1, r.output
    assert words in r.output


def test_evidence_settings_and_provenance_differences_do_not_count(engine_here, tmp_path):
    data = shipped_data()
    data["regions"]["rope"]["evidence"]["match_rate"] = 0.5
    data["engine"]["torch_version"] = "2.0.0"
    data["provenance"]["date"] = "2020-01-01T00:00:00Z"
    r = run(str(write(tmp_path, data)))
    assert r.exit_code == 0, r.output
    assert "other differences" in r.output and "0.5" in r.output


def test_regions_the_profile_did_not_probe_are_neither_probed_nor_compared(engine_here, tmp_path):
    data = shipped_data()
    data["regions"]["swiglu"] = NOT_PROBED
    data = as_schema_version(data, 1)  # schema version 1: attention recorded as not probed
    r = run(str(write(tmp_path, data)))
    assert r.exit_code == 0, r.output
    assert engine_here["calls"][0].regions == ("rope", "add_rmsnorm", "rmsnorm")
    assert "swiglu: not compared" in r.output and "attention: not compared" in r.output
    assert "schema version 1" in r.output


def test_another_cpu_capability_is_compared_with_a_note(engine_here, tmp_path):
    data = shipped_data()
    data["engine"]["settings"]["cpu_capability"] = "AVX2"
    r = run(str(write(tmp_path, data)))
    assert r.exit_code == 0, r.output
    assert "note:" in r.output and "CPU capability is AVX512, the profile's AVX2" in r.output
    assert "compared all the same" in r.output
    r = run(VLLM)
    assert "CPU capability" not in r.output


def test_another_installed_version_exits_1_without_probing(engine_here):
    engine_here["version"] = "0.31.0"
    r = run(VLLM)
    assert r.exit_code == 1, r.output
    assert "installed vllm version 0.31.0" in r.output and "differs from the profile's 0.32.0" in r.output
    assert not engine_here["calls"]
    engine_here["version"] = "0.32.0+cpu"  # a local part is the same version
    assert run(VLLM).exit_code == 0


def test_another_installed_version_here_hands_over_to_the_profiles_versions_environment(engine_here, monkeypatch):
    engine_here["version"] = "0.31.0"
    mine = _env(probe_runner.ENGINES_DIR, "vllm-0.32.0")
    calls = []
    monkeypatch.setattr(probe_runner, "reexec_in", lambda python, argv, note, codes: calls.append(python) or 0)
    assert run(VLLM).exit_code == 0
    assert calls == [mine] and not engine_here["calls"]


def test_the_engines_own_version_is_checked_before_probing(monkeypatch):
    # The distribution's metadata agrees, the imported engine does not: refused before the probe.
    from engineprofiles.probe import harness
    from engineprofiles.probe.base import EngineInfo

    class Fake:
        def info(self):
            return EngineInfo(name="vllm", version="0.33.0.dev1", backend="cpu", device="x", torch_version="t",
                              execution_mode="inductor", settings={})

    monkeypatch.setattr("engineprofiles.probe.adapters.make_adapter", lambda *a, **k: Fake())
    monkeypatch.setattr(harness, "run_probe", lambda *a, **k: pytest.fail("probed another version"))
    plan = chk.plan_for(store.get_profile(VLLM), VLLM)
    with pytest.raises(chk.InstalledVersionDiffers, match="0.33.0.dev1 .* differs from the profile's 0.32.0"):
        chk.reprobe(plan, lambda m: None)


def test_several_profiles_of_one_setting_are_probed_once_and_reported_each(engine_here, tmp_path):
    bad = write(tmp_path, doctored(shipped_data()), "bad.yaml")
    r = cli.invoke(app, ["check", VLLM, str(bad), "vllm-0.32.0-cpu-eager-bfloat16", "-f", "json"])
    assert r.exit_code == 1, r.output
    out = json.loads(r.stdout)
    assert [p["exit_code"] for p in out["profiles"]] == [0, 1, 1]  # the eager one is compared with a compiled probe
    assert [c.mode for c in engine_here["calls"]] == ["compiled", "eager"]
    first, second = out["profiles"][0], out["profiles"][1]
    assert first["points_agree"] is True and first["differences"] == []
    assert second["differences"] == [dict(region="swiglu", name="silu", kind="site", profile="rounded", now="fp32")]
    assert (out["engine"], out["version"], out["installed_version"], out["exit_code"]) == ("vllm", "0.32.0", "0.32.0", 1)


def test_markdown_format(engine_here, tmp_path):
    r = cli.invoke(app, ["check", str(write(tmp_path, doctored(shipped_data()))), "-f", "markdown"])
    assert r.exit_code == 1
    assert "| swiglu | silu | rounded | fp32 | **differs** |" in r.stdout and "drift:" in r.stdout


def test_an_engine_name_chooses_the_shipped_profile(engine_here):
    r = run("vllm==0.32.0:eager")
    assert "vllm==0.32.0:eager: vllm-0.32.0-cpu-eager-bfloat16" in r.output
    assert engine_here["calls"][0].mode == "eager"


@pytest.mark.parametrize("args,words", [
    (["nope.yaml"], "no profile file or shipped profile named 'nope.yaml'"),
    ([VLLM + "-insitu"], "fitted in situ"),
    (["vllm-0.28.0-cpu-inductor-bfloat16", VLLM], "check the profiles of one engine version per run"),
    ([VLLM, "-f", "xml"], "--format must be table, markdown or json"),
])
def test_bad_input_exits_2_before_probing(engine_here, args, words):
    r = run(*args)
    assert r.exit_code == 2, r.output
    assert "error:" in r.output and words in r.output
    assert not engine_here["calls"]


def test_a_crash_while_probing_exits_2_not_1(engine_here, monkeypatch):
    def crash(plan, progress):
        raise RuntimeError("boom")

    monkeypatch.setattr(chk, "reprobe", crash)
    r = run(VLLM)
    assert r.exit_code == 2, r.output
    assert "the probe failed (RuntimeError: boom); that is an error, not a rounding difference" in r.output


# -- the engine's environment ------------------------------------------------------------------------


def _env(root: Path, name: str) -> Path:
    python = root / name / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    (root / name / ".ready").touch()
    return python


@pytest.fixture
def no_engine_here(monkeypatch, tmp_path):
    monkeypatch.setattr(probe_runner, "ENGINES_DIR", tmp_path / "engines")
    monkeypatch.setattr(probe_runner, "engine_importable", lambda e: False)
    monkeypatch.delenv("ENGINEPROFILES_REEXEC", raising=False)
    monkeypatch.setattr(chk, "reprobe", lambda *a: pytest.fail("probed in this process"))
    calls = []

    def reexec(python, argv, note, codes=(0, 2)):
        calls.append((python, argv, codes))
        return 1

    monkeypatch.setattr(probe_runner, "reexec_in", reexec)
    return tmp_path / "engines", calls


def test_no_engine_environment_exits_2_and_says_how_to_make_one(no_engine_here):
    r = run(VLLM)
    assert r.exit_code == 2, r.output
    assert "not installed" in r.output and "scripts/engine_env.sh vllm" in r.output


def test_it_runs_in_the_environment_of_the_profiles_version_and_passes_its_exit_code_on(no_engine_here, tmp_path):
    engines, calls = no_engine_here
    newest = _env(engines, "vllm-0.40.0")
    mine = _env(engines, "vllm-0.32.0")
    r = run(VLLM, "-f", "json")
    assert r.exit_code == 1, r.output  # what the engine environment's run exited with
    assert calls == [(mine, ["check", VLLM, "--format", "json"], (0, 1, 2))]
    # without an environment of that version, the newest (which will say that it is another version)
    calls.clear()
    r = run("vllm-0.28.0-cpu-inductor-bfloat16")
    assert calls[0][0] == newest and "no vllm-0.28.0 environment" in r.output
    # --env chooses
    calls.clear()
    run(VLLM, "--env", str(newest))
    assert calls[0][0] == newest


def test_an_engine_name_is_passed_on_as_the_profile_it_chose(no_engine_here):
    engines, calls = no_engine_here
    _env(engines, "vllm-0.32.0")
    run("vllm==0.32.0:eager")
    assert calls[0][1][:2] == ["check", "vllm-0.32.0-cpu-eager-bfloat16"]


# -- for real, with transformers (in this process) -----------------------------------------------------


def test_transformers_shipped_profile_and_a_doctored_copy_in_one_probe(tmp_path):
    """One probe of the installed transformers: the shipped trainer profile agrees with it at every point (exit 0:
    the claim that the trainer rounds where its profile says, on this machine) and a doctored copy does not."""
    import transformers

    name = f"transformers-{transformers.__version__}-cpu-eager-bfloat16"
    if not (store.shipped_dir() / f"{name}.yaml").is_file():
        pytest.fail(f"no shipped profile {name} for the installed transformers", pytrace=False)
    # check leaves out the regions a profile did not probe; the shipped trainer profile probed every one, so its
    # exit 0 is the whole profile's agreement (what test_real_engines' own probe of transformers asserted)
    assert chk.skipped(store.get_profile(name)) == []
    bad = write(tmp_path, doctored(shipped_data(name), "rmsnorm", "output"), "bad.yaml")
    r = cli.invoke(app, ["check", name, str(bad), "-f", "json"])
    assert r.exit_code == 1, r.output
    out = json.loads(r.stdout)
    assert [p["exit_code"] for p in out["profiles"]] == [0, 1]
    assert out["profiles"][1]["differences"] == [
        dict(region="rmsnorm", name="output", kind="site", profile="fp32", now="rounded")]
    assert "re-probing transformers" in r.output and "rmsnorm: probing" in r.output  # progress on stderr
