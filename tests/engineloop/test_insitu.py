"""In-situ fit and mismatch report, with a trainer-side stand-in for the engine (the real engine
runs in tests/engines)."""

import json
import os

import pytest
import torch

from engineprofiles.errors import EngineProfilesError
from engineloop.fit import compare, fit_profile
from engineloop.mismatch import combine, run_mismatch
from engineloop.standin import capture_from_trainer
from engineprofiles.models import tiny_model
from engineloop import runner
from engineprofiles.store import get_profile

from .helpers import evil_capture

import triton  # noqa: F401,E402  the emulator is a test dependency: without it these tests fail, never skip

ENGINE = "vllm-0.32.0-cpu-inductor-bfloat16"
TRAINER = "transformers-5.19.0-cpu-eager-bfloat16"


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=0).eval()


@pytest.fixture(scope="module")
def planted(model):
    target = get_profile(ENGINE)
    return target, capture_from_trainer(model, target, prompts=2)


@pytest.mark.parametrize("region", ["swiglu", "add_rmsnorm"])
def test_in_situ_fit_finds_a_planted_rounding_difference(model, planted, region):
    target, cap = planted
    start = combine(target, get_profile(TRAINER), (region,))  # one region planted wrong
    assert start.point(region) != target.point(region)
    fit = fit_profile(model, cap, start, regions=(region,), passes=1)
    spec_sites = lambda p: {k: p[k] for k in p if k in ("silu", "variance_input", "normalize_input", "normalized", "residual_out")}
    assert spec_sites(fit.points[region]) == spec_sites(target.point(region))
    assert fit.best.total.rate == 1.0
    assert fit.start.total.rate < 1.0
    # Per layer: the first layer's q/k do not depend on the region after attention; later layers do.
    assert fit.best.layers["L1.q"].rate == 1.0 and fit.start.layers["L1.q"].rate < 1.0


def test_teacher_forced_stand_in_matches_itself_bitwise(model, planted):
    target, cap = planted
    from emulator.patching import apply_profile

    with apply_profile(model, target):
        res = compare(model, cap, "self")
    assert res.total.rate == 1.0
    # The comparison can fail: the same model patched with another profile (the trainer's own
    # rounding) does not reproduce the capture.
    with apply_profile(model, get_profile(TRAINER)):
        other = compare(model, cap, "trainer")
    assert other.total.rate < 1.0


def test_a_trainer_compared_with_itself_reports_zero_mismatch(model, tmp_path):
    cap = capture_from_trainer(model, None, prompts=2)
    f = tmp_path / "cap.pt"
    torch.save(cap, f)
    rep = run_mismatch("vllm", family="qwen2", profile=TRAINER, capture_file=str(f))
    as_is = dict(rep.rows)["as-is"]
    assert as_is.exact_match == 1.0 and as_is.k3_kl == 0.0 and as_is.abs_dlogp_max == 0.0
    # The trainer's own profile applied changes nothing either.
    assert dict(rep.rows)["+ engine profile"].exact_match == 1.0
    assert dict(rep.prefill_rows)["+ profile + engine attention"].exact_match == 1.0
    # Not by construction: another engine's profile applied to the same trainer moves its log-probs.
    rep2 = run_mismatch("vllm", family="qwen2", profile=ENGINE, capture_file=str(f))
    assert dict(rep2.rows)["+ engine profile"].exact_match < 1.0


def test_mismatch_warns_about_a_profile_from_another_engine(model, tmp_path):
    cap = capture_from_trainer(model, None, prompts=1)
    f = tmp_path / "cap.pt"
    torch.save(cap, f)
    rep = run_mismatch("vllm", family="qwen2", profile=ENGINE, capture_file=str(f))
    assert rep.warnings and "vllm" in rep.warnings[0] and "transformers" in rep.warnings[0]


def test_mismatch_on_a_scaled_rope_model_records_it_and_checks_a_capture_against_it(tmp_path):
    from engineprofiles.errors import ArgumentError

    scaled = tiny_model("llama", seed=0, rope_scaling="llama3")
    cap = capture_from_trainer(scaled, None, prompts=1)
    f = tmp_path / "cap.pt"
    torch.save(dict(cap, family="llama", rope_scaling="llama3"), f)
    rep = run_mismatch("vllm", family="llama", profile=ENGINE, capture_file=str(f), rope_scaling="llama3")
    assert rep.model["rope_parameters"]["rope_type"] == "llama3" and rep.model["rope_parameters"]["factor"] == 8.0
    with pytest.raises(EngineProfilesError, match="captured on a model with RoPE scaling llama3, not default RoPE"):
        run_mismatch("vllm", family="llama", profile=ENGINE, capture_file=str(f))
    with pytest.raises(EngineProfilesError, match="RoPE scaling llama3, not RoPE scaling linear"):
        run_mismatch("vllm", family="llama", profile=ENGINE, capture_file=str(f), rope_scaling="linear")
    with pytest.raises(ArgumentError, match="unknown RoPE scaling 'ntk'; scalings: llama3, linear, yarn"):
        run_mismatch("vllm", family="llama", rope_scaling="ntk")
    plain = run_mismatch("vllm", family="llama", profile=ENGINE, capture_file=str(_saved(tmp_path, "llama")))
    assert "rope_parameters" not in plain.model


def _saved(tmp_path, family):
    cap = capture_from_trainer(tiny_model(family, seed=0), None, prompts=1)
    f = tmp_path / f"{family}.pt"
    torch.save(dict(cap, family=family), f)
    return f


def test_mismatch_refuses_an_unknown_family():
    with pytest.raises(EngineProfilesError, match="unknown model family 'gpt2'"):
        run_mismatch("vllm", family="gpt2")


def test_mismatch_without_the_engine_environment_names_the_script(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "ENGINES_DIR", tmp_path)
    with pytest.raises(EngineProfilesError, match="scripts/engine_env.sh vllm"):
        run_mismatch("vllm", family="qwen2", workdir=str(tmp_path))


def test_an_in_situ_profile_records_the_machine_the_engine_ran_on(model, planted):
    # The engine description comes from the op-level start, but the evidence was measured where
    # the capture ran: its CPU capability and torch version win.
    from engineloop.fit import in_situ_profile

    target, cap = planted
    cap = dict(cap, engine=dict(cap["engine"], cpu_capability="TEST_ISA", torch_version="9.9.9+test"))
    fit = fit_profile(model, cap, target, regions=("swiglu",), passes=1)
    prof = in_situ_profile(fit, target, cap, "qwen2", "probe-engine vllm")
    assert prof.engine.settings["cpu_capability"] == "TEST_ISA" != target.engine.settings["cpu_capability"]
    assert prof.engine.torch_version == "9.9.9+test"
    assert prof.engine.settings["in_situ_family"] == "qwen2" and prof.provenance.method == "in-situ"
    # The MoE experts measured op-level on another capability are not carried over: not known here.
    assert target.available("moe") and not prof.available("moe") and "TEST_ISA" in prof.moe.evidence.reason
    assert target.available("shared_expert") and not prof.available("shared_expert")
    assert "TEST_ISA" in prof.shared_expert.evidence.reason


def test_an_in_situ_profile_carries_the_op_level_moe_entries_measured_on_the_same_capability(model, planted):
    from engineloop.fit import in_situ_profile

    target, cap = planted
    cap = dict(cap, engine=dict(cap["engine"], cpu_capability=target.engine.settings["cpu_capability"]))
    fit = fit_profile(model, cap, target, regions=("swiglu",), passes=1)
    prof = in_situ_profile(fit, target, cap, "qwen2", "probe-engine vllm")
    assert prof.available("moe") and prof.point("moe") == target.point("moe")
    assert prof.moe.evidence.match_rate == target.moe.evidence.match_rate
    assert any("carried over from " + target.canonical_name in n for n in prof.moe.evidence.notes)
    assert prof.available("shared_expert") and prof.point("shared_expert") == target.point("shared_expert")
    assert any("carried over from " + target.canonical_name in n for n in prof.shared_expert.evidence.notes)


def test_a_capture_is_loaded_without_running_code_from_the_file(tmp_path):
    from engineloop.mismatch import CaptureError, load_capture

    f, marker = evil_capture(tmp_path)
    with pytest.raises(CaptureError, match="weights_only"):
        run_mismatch("vllm", family="qwen2", capture_file=str(f))
    assert not marker.exists()
    with pytest.raises(CaptureError, match="does not exist"):
        load_capture(tmp_path / "absent.pt")


def test_a_capture_without_what_the_fit_needs_or_with_a_path_for_a_version_is_refused(model, tmp_path):
    from engineloop.mismatch import CaptureError, load_capture

    cap = capture_from_trainer(model, None, prompts=1)
    f = tmp_path / "cap.pt"
    torch.save(dict(cap, engine=dict(cap["engine"], version="../../etc/x")), f)
    with pytest.raises(CaptureError, match="engine.version must be a plain name"):
        load_capture(f)
    torch.save(dict(cap, sequences=[{"prompt": [1]}]), f)
    with pytest.raises(CaptureError, match="sequence 0 lacks completion"):
        load_capture(f)
    torch.save(cap, f)
    assert load_capture(f)["engine"] == cap["engine"]


@pytest.mark.parametrize("here,shipped,want", [
    ("AVX512", ["vllm-0.32.0-cpu-inductor-bfloat16", "vllm-0.32.0-cpu-inductor-bfloat16-insitu",
                "vllm-0.32.0-cpu-inductor-bfloat16-insitu-avx2"], "vllm-0.32.0-cpu-inductor-bfloat16-insitu"),
    ("AVX2", ["vllm-0.32.0-cpu-inductor-bfloat16", "vllm-0.32.0-cpu-inductor-bfloat16-insitu",
              "vllm-0.32.0-cpu-inductor-bfloat16-insitu-avx2"], "vllm-0.32.0-cpu-inductor-bfloat16-insitu-avx2"),
    ("AVX2", ["vllm-0.32.0-cpu-inductor-bfloat16", "vllm-0.32.0-cpu-inductor-bfloat16-insitu"],
     "vllm-0.32.0-cpu-inductor-bfloat16-insitu"),  # none for AVX2: the AVX512 one (a capability warning follows)
    ("AVX2", ["vllm-0.32.0-cpu-inductor-bfloat16-avx2", "vllm-0.32.0-cpu-inductor-bfloat16-insitu"],
     "vllm-0.32.0-cpu-inductor-bfloat16-avx2"),  # this capability's comes before in situ
    ("AVX512", ["vllm-0.28.0-cpu-inductor-bfloat16-insitu", "vllm-0.32.0-cpu-eager-bfloat16"],
     "vllm-0.32.0-cpu-inductor-bfloat16"),  # none of this version and mode: the name it would have
])
def test_the_default_profile_of_a_run_is_this_capabilitys(monkeypatch, here, shipped, want):
    """The rule of apply_profile(model, "vllm==0.32.0") (engineprofiles.select), over candidates
    described by name: version, mode, capability (no suffix: AVX512) and method."""
    from engineloop import mismatch
    from engineprofiles import store
    from engineprofiles.select import Candidate

    def candidate(name: str) -> Candidate:
        _, version, backend, mode, dtype, *rest = name.split("-")
        cap = next((r.upper() for r in rest if r != "insitu"), "AVX512")
        return Candidate(name=name, engine="vllm", version=version, mode=mode, dtype=dtype, backend=backend,
                         capability=cap, method="in-situ" if "insitu" in rest else "op-level",
                         date="2026-12-04T00:00:00Z")

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: here)
    monkeypatch.setattr(store, "candidates", lambda: ([(None, candidate(n)) for n in shipped], []))
    assert mismatch.default_profile_name("vllm", "0.32.0") == want


def test_combine_takes_the_entries_beside_the_regions_from_the_base_unless_named():
    """The ablation rows of `mismatch` (`+ rope only`, ..., `+ moe only`) are the trainer's profile
    with one part of the engine's: attention and the MoE experts come along from the base (the
    trainer's) unless named."""
    target, trainer = get_profile(ENGINE), get_profile(TRAINER)
    assert target.point("moe") != trainer.point("moe")
    rope_only = combine(trainer, target, ("rope",))
    assert rope_only.point("rope") == target.point("rope") and rope_only.point("swiglu") == trainer.point("swiglu")
    assert rope_only.point("moe") == trainer.point("moe") and rope_only.point("attention") == trainer.point("attention")
    moe_only = combine(trainer, target, ("moe",))
    assert moe_only.point("moe") == target.point("moe") and moe_only.point("rope") == trainer.point("rope")
    assert moe_only.moe.evidence == target.moe.evidence


def test_an_moe_model_is_fitted_with_the_start_profiles_moe_entry():
    """The fit's candidate profiles keep the start's attention and MoE entries (with_points): a Qwen3-MoE
    model, which apply_profile refuses without a measured moe entry, is fitted like the others."""
    target = get_profile(ENGINE)
    model = tiny_model("qwen3_moe", seed=1)  # two layers: layer 1's q and k see layer 0's experts
    cap = capture_from_trainer(model, target, prompts=1)
    start = combine(target, get_profile(TRAINER), ("rope",))  # RoPE planted wrong
    assert start.point("moe") == target.point("moe")  # combine keeps the base's moe entry
    fit = fit_profile(model, cap, start, regions=("rope",), passes=1)
    assert fit.points["rope"] == target.point("rope") and fit.best.total.rate == 1.0


def test_with_points_replaces_what_it_names_and_keeps_the_rest_with_its_evidence():
    from engineprofiles.schema import with_points

    prof = get_profile(ENGINE)
    other = get_profile(TRAINER)
    p = with_points(prof, {"rope": other.point("rope"), "moe": None})
    assert p.point("rope") == other.point("rope") and not p.available("moe")
    assert p.point("swiglu") == prof.point("swiglu") and p.entry("swiglu").evidence == prof.entry("swiglu").evidence
    assert p.point("attention") == prof.point("attention") and p.provenance.method == "synthetic"


def test_an_in_situ_fit_on_scaled_rope_models_says_so_and_refuses_a_capture_of_another_rope(model, planted, tmp_path):
    """--rope-scaling for the in-situ fit: the profile records the tiny models' RoPE scaling (settings and
    every region's note); a capture recorded with another RoPE than asked is refused, naming both."""
    from typer.testing import CliRunner

    from engineloop.cli import app
    from engineloop.fit import in_situ_profile

    target, cap = planted
    scaled = dict(cap, rope_scaling="llama3")
    fit = fit_profile(model, scaled, target, regions=("swiglu",), passes=1)
    prof = in_situ_profile(fit, target, scaled, "qwen2", "probe-engine vllm --rope-scaling llama3")
    assert prof.engine.settings["in_situ_rope_scaling"] == "llama3"
    assert "tiny qwen2 models with llama3 RoPE scaling" in prof.entry("rope").evidence.notes[0]
    plain = in_situ_profile(fit, target, cap, "qwen2", "probe-engine vllm")
    assert "in_situ_rope_scaling" not in plain.engine.settings and "RoPE scaling" not in plain.entry("rope").evidence.notes[0]
    f = tmp_path / "cap.pt"
    torch.save(dict(cap, family="qwen2", rope_scaling=None), f)
    r = CliRunner().invoke(app, ["vllm", "--in-situ", "--family", "qwen2", "--capture", str(f), "--rope-scaling",
                                 "llama3", "-o", str(tmp_path)])
    assert r.exit_code == 2 and "captured on a model with default RoPE, not RoPE scaling llama3" in r.output, r.output
    assert not list(tmp_path.glob("*.yaml"))


def test_an_in_situ_probe_prints_a_summary_that_fits_an_80_column_terminal_in_60_lines(model, planted, tmp_path):
    """The main job (scripts/probe.sh vllm, in situ) prints a summary, one row per region, never every
    column cut; the whole profile is the file it names (probe-engine show FILE)."""
    from typer.testing import CliRunner

    from engineloop.cli import app

    target, cap = planted
    f = tmp_path / "cap.pt"
    engine = dict(cap["engine"], name="vllm", version="0.32.0")  # as the engine's capture names itself
    torch.save(dict(cap, family="qwen2", rope_scaling=None, engine=engine), f)
    out = tmp_path / "out"
    out.mkdir()
    timings = tmp_path / "timings.json"
    r = CliRunner().invoke(app, ["vllm", "--in-situ", "--family", "qwen2", "--capture", str(f), "-o", str(out)],
                            env={"COLUMNS": "80", "ENGINEPROFILES_TIMINGS": str(timings)})
    assert r.exit_code == 0, r.output
    phases = json.loads(timings.read_text())  # scripts/bench_probe.py --in-situ reads them
    assert list(phases) == ["capture", "fit regions", "fit attention", "self-check", "total"], phases
    assert abs(sum(v for k, v in phases.items() if k != "total") - phases["total"]) < 0.1, phases
    lines = r.output.splitlines()
    written = next(out.glob("*.yaml"))
    assert len(lines) <= 60, "\n".join(lines)
    assert f"probe-engine show {written}" in r.output.replace("\n", "")
    assert all(x in r.output for x in ("swiglu", "silu=", "in situ: bitwise match per captured tensor"))
    assert not any("…" in ln for ln in lines), r.output


def test_the_engine_loads_a_model_from_a_path_named_by_its_content(tmp_path, monkeypatch):
    """vLLM keys its compile cache on the model's path: captures load the model from a copy whose path is its
    files' hash, so the same tiny model saved twice hits the cache. Same files, same path; other files, another;
    copies (a file rewritten later leaves them); a folder with a subfolder or over the size bound stays where it is."""
    from engineloop import capture

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for d, w in ((a, b"weights"), (b, b"weights"), (c, b"weightz")):
        d.mkdir()
        (d / "config.json").write_text('{"hidden_size": 8}')
        (d / "model.safetensors").write_bytes(w)
    pa, pb, pc = (capture.content_addressed(str(d)) for d in (a, b, c))
    assert pa == pb != pc and pa.startswith(str(tmp_path / "cache" / "engineprofiles" / "models"))
    assert sorted(os.listdir(pa)) == ["config.json", "model.safetensors"]
    (a / "model.safetensors").write_bytes(b"changed")  # rewritten in place: the copy keeps what it was made from
    assert open(os.path.join(pb, "model.safetensors"), "rb").read() == b"weights"
    assert capture.content_addressed(str(a)) not in (pa, pc)
    (c / "sub").mkdir()
    assert capture.content_addressed(str(c)) == str(c)
    monkeypatch.setattr(capture, "CONTENT_ADDRESSED_MAX_BYTES", 4)
    assert capture.content_addressed(str(b)) == str(b)
    assert not [n for n in os.listdir(tmp_path / "cache" / "engineprofiles" / "models") if n.startswith(".new-")]
