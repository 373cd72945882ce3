"""Divergence localizer against a trainer-side stand-in for the engine (an HF model patched with a
planted profile, recording what an eager engine shows); the real engine runs in
tests/engines/test_localize_engine.py."""

import json

import pytest
import torch
from typer.testing import CliRunner

from engineloop.cli import app
from engineloop.localize import (
    compare_tensors, engine_tensors, first_divergence, localize, neighbours,
    run_localize, tensor_names, with_point,
)
from engineloop.standin import capture_from_trainer
from engineprofiles.errors import EngineProfilesError
from engineprofiles.models import tiny_model
from engineprofiles.regions import ATTENTION_SPEC, REGIONS
from engineprofiles.store import get_profile

import triton  # noqa: F401,E402  the emulator is a test dependency: without it these tests fail, never skip

ENGINE = "vllm-0.32.0-cpu-eager-bfloat16"  # has the engine's attention measured
TRAINER = "transformers-5.19.0-cpu-eager-bfloat16"


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=0).eval()


@pytest.fixture(scope="module")
def engine_profile():
    return get_profile(ENGINE)


@pytest.fixture(scope="module")
def planted(model, engine_profile):
    """What an eager engine rounding as ENGINE (its attention too) would show."""
    return capture_from_trainer(model, engine_profile, attention=engine_profile.point("attention"), modules=True)


def test_the_stand_in_records_every_tensor_an_eager_engine_shows(planted):
    names = list(engine_tensors(planted["sequences"][0]))
    assert names == tensor_names(2)


def test_exact_trainer_matches_the_planted_engine_everywhere(model, planted, engine_profile):
    loc = localize(model, planted, "exact", engine_profile, get_profile(TRAINER))
    assert loc.first is None and all(r.exact for r in loc.rows)
    assert [r.name for r in loc.rows] == tensor_names(2)


@pytest.mark.parametrize("region,tensor", [("swiglu", "L0.mlp_out"), ("rope", "L0.q")])
def test_a_profile_wrong_in_one_region_diverges_first_where_that_region_computes(model, planted, engine_profile,
                                                                                 region, tensor):
    """One region's site planted wrong (a lattice neighbour of the engine's point): the first
    differing tensor is the one that region computes, and the change back removes it."""
    spec, want = REGIONS[region], engine_profile.point(region)
    wrong = next(p for p in neighbours(spec, want) if spec.site_part(p) != spec.site_part(want))
    (k,) = [k for k in want if wrong[k] != want[k]]
    doctored = with_point(engine_profile, region, wrong)
    loc = localize(model, planted, "exact", doctored, get_profile(TRAINER))
    assert loc.first is not None and loc.first.name == tensor, (wrong, [(r.name, r.rate) for r in loc.rows])
    rows = {r.name: r for r in loc.rows}
    before = tensor_names(2)[:tensor_names(2).index(tensor)]
    assert all(rows[n].exact for n in before)
    back = [f for f in loc.fixes if f.change == f"{region}: {k}={want[k]}"]
    assert back and back[0].removes and back[0].first_after is None, [f.change for f in loc.fixes]
    assert loc.fixes == sorted(loc.fixes, key=lambda f: (-f.moves_later, -f.rate_at_first, f.change))


def test_the_trainer_as_is_diverges_and_the_engine_profile_in_exact_mode_removes_it(model, planted, engine_profile):
    loc = localize(model, planted, "as-is", engine_profile, get_profile(TRAINER))
    assert loc.first is not None
    best = loc.fixes[0]
    assert best.change == "apply the engine's profile, exact=True" and best.removes and best.first_after is None


def test_profile_only_trainer_diverges_first_at_attention_and_exact_mode_is_the_fix(model, planted, engine_profile):
    loc = localize(model, planted, "profile", engine_profile, get_profile(TRAINER))
    assert loc.first.name == "L0.attn_out"
    assert loc.fixes[0].change.startswith("exact=True") and loc.fixes[0].first_after is None
    d = loc.as_dict()
    assert d["first_divergence"]["tensor"] == "L0.attn_out" and d["first_divergence"]["layer"] == 0
    assert "attention" in d["first_divergence"]["produced_by"]


def test_a_compiled_engine_capture_compares_what_crosses_attention_only(model, planted, engine_profile):
    seq = dict(planted["sequences"][0], modules=None)
    cap = dict(planted, sequences=[seq])
    rows = localize(model, cap, "exact", engine_profile, get_profile(TRAINER)).rows
    assert [r.name for r in rows] == [f"L{i}.{t}" for i in range(2) for t in ("q", "k", "v", "attn_out")] + [
        "final_norm", "logprobs"]


def test_neighbours_differ_in_one_choice_and_are_canonical():
    for spec in list(REGIONS.values()) + [ATTENTION_SPEC]:
        p = spec.all_points()[0]
        ns = neighbours(spec, p)
        assert ns and p not in ns and len(set(ns)) == len(ns)
        assert all(spec.is_canonical(n) for n in ns)


def test_first_divergence_counts_partial_matches_as_divergence(model, planted, engine_profile):
    rows = compare_tensors(model, planted)  # the model unpatched: not the planted engine
    i = first_divergence(rows)
    assert i < len(rows) and not rows[i].exact and all(r.exact for r in rows[:i])


def test_bad_input_is_a_clear_error(model, planted, engine_profile):
    with pytest.raises(EngineProfilesError, match="unknown trainer"):
        localize(model, planted, "patched", engine_profile, get_profile(TRAINER))
    empty = dict(planted, sequences=[dict(planted["sequences"][0], layers=[None, None])])
    with pytest.raises(EngineProfilesError, match="nothing to localize"):
        compare_tensors(model, empty)
    with pytest.raises(EngineProfilesError, match="--trainer"):
        run_localize(trainers=("nonsense",))


def test_cli_localizes_a_saved_capture_and_writes_json(tmp_path, planted):
    cap = dict(planted, model_size={}, family="qwen2")
    f = tmp_path / "cap.pt"
    torch.save(cap, f)
    out = tmp_path / "loc.json"
    r = CliRunner().invoke(app, ["localize", "--capture", str(f), "--profile", ENGINE, "--trainer", "profile",
                                 "--trainer", "exact", "--json", str(out)])
    assert r.exit_code == 0, (r.output, r.exception)
    said = " ".join(r.output.split())
    assert "first divergence at L0.attn_out" in said and "exact=True" in said
    assert "every observed tensor bit-equal" in said
    d = json.loads(out.read_text())
    assert [t["trainer"] for t in d["trainers"]] == ["profile", "exact"]
    assert d["trainers"][1]["first_divergence"] is None
    assert all(x["match_rate"] == 1.0 for x in d["trainers"][1]["tensors"])


def test_cli_refuses_bad_options_before_any_engine_runs(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr("engineloop.localize.run_localize", lambda *a, **k: ran.append(1))
    for args, words in ((["--trainer", "nonsense"], "--trainer"), (["--family", "gpt2"], "gpt2"),
                        (["--prompts", "0"], "positive"), (["sglang"], "vllm only"),
                        (["--json", str(tmp_path)], "cannot write"),
                        (["--rope-scaling", "ntk"], "unknown RoPE scaling 'ntk'")):
        r = CliRunner().invoke(app, ["localize", *args])
        assert r.exit_code == 2, (args, r.output)
        assert words in " ".join(r.output.split()), (args, r.output)
    assert not ran
