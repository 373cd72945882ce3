"""The batch check of `probe-engine mismatch --batch-check`: the analysis of the engine's log-probs of
the same sequences in other batch compositions, on captures made by hand (the real engines run it in
tests/engines)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from engineloop.capture import batch_compositions
from engineloop.mismatch import CaptureError, batch_invariance, run_mismatch
from engineloop.standin import capture_from_trainer
from engineprofiles.errors import EngineProfilesError
from engineprofiles.models import tiny_model

TRAINER = "transformers-5.19.0-cpu-eager-bfloat16"


def one_ulp_up(x: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(np.inf)))


def capture(prefill_runs: dict[str, list[list[float]]], sampled: list[list[int]], sampled_lp: list[list[float]]):
    seqs = [dict(prompt=[1, 2], completion=[5, 6, 7, 8], sample_logprobs=[-0.5, -0.25, -1.5, -2.0],
                 prompt_logprobs=[None, -1.0, -0.5, -0.25, -1.5, -2.0], layers=[None]),
            dict(prompt=[3, 4, 9], completion=[7, 7, 7, 7], sample_logprobs=[-0.125, -3.0, -0.75, -0.5],
                 prompt_logprobs=[None, -2.5, -4.0, -0.125, -3.0, -0.75, -0.5], layers=[None])]
    runs = [dict(name=name, kind="prefill", calls=[[0, 1]], logprobs=lps, forward_tokens=[13])
            for name, lps in prefill_runs.items()]
    runs.append(dict(name="decoded alone (greedy)", kind="decode", calls=[[0], [1]], logprobs=SAMPLED_LP,
                     completions=SAMPLED, forward_tokens=[2, 1, 1, 1, 3, 1, 1, 1]))
    runs.append(dict(name="decoded together", kind="decode", calls=[[0, 1]], logprobs=sampled_lp,
                     completions=sampled, forward_tokens=[5, 2, 2, 2], reference="decoded alone (greedy)"))
    return dict(engine=dict(name="vllm", version="0.32.0"), sequences=seqs,
                batch_check=dict(max_num_seqs=2, prefix_caching=False, runs=runs))


ALONE = [[-1.0, -0.5, -0.25, -1.5, -2.0], [-2.5, -4.0, -0.125, -3.0, -0.75, -0.5]]
SAMPLED = [[5, 6, 7, 8], [7, 7, 7, 7]]
SAMPLED_LP = [[-0.5, -0.25, -1.5, -2.0], [-0.125, -3.0, -0.75, -0.5]]


def test_the_same_log_probs_in_every_composition_are_batch_invariant():
    r = batch_invariance(capture({"all together": ALONE}, SAMPLED, SAMPLED_LP))
    assert r["batch_invariant"] is True
    rows = {x["composition"]: x for x in r["rows"]}
    assert rows["all together"]["tokens"] == 11 and rows["all together"]["exact_match"] == 1.0
    assert rows["decoded together"]["tokens"] == 8 and rows["decoded together"]["diverged"] == 0
    assert rows["all together"]["forward_tokens"] == [13] and rows["all together"]["requests_per_call"] == [2]


def test_one_fp32_ulp_of_difference_in_one_token_breaks_invariance():
    # One FP32 ulp in one prefill log-prob: batch-dependent, and the row says by how much.
    moved = [list(ALONE[0]), list(ALONE[1])]
    moved[1][3] = one_ulp_up(moved[1][3])
    r = batch_invariance(capture({"all together": ALONE, "all together, reversed": moved}, SAMPLED, SAMPLED_LP))
    assert r["batch_invariant"] is False
    rows = {x["composition"]: x for x in r["rows"]}
    assert rows["all together"]["exact_match"] == 1.0
    bad = rows["all together, reversed"]
    assert bad["equal"] == 10 and bad["tokens"] == 11
    assert bad["abs_dlogp_max"] == abs(one_ulp_up(-3.0) - -3.0) > 0


def test_decode_is_compared_up_to_the_first_token_decoded_otherwise():
    # The second sequence decoded another token at position 2 when batched: its first two log-probs
    # are compared (equal), the rest are not comparable, and the divergence alone breaks invariance.
    other = [[5, 6, 7, 8], [7, 7, 1, 2]]
    lp = [list(SAMPLED_LP[0]), [-0.125, -3.0, -9.0, -9.0]]
    r = batch_invariance(capture({"all together": ALONE}, other, lp))
    dec = {x["composition"]: x for x in r["rows"]}["decoded together"]
    assert dec["tokens"] == 4 + 2 and dec["equal"] == 6 and dec["diverged"] == 1
    assert r["batch_invariant"] is False


def test_a_run_with_another_number_of_log_probs_is_an_error():
    short = [ALONE[0][:-1], ALONE[1]]
    with pytest.raises(CaptureError, match="4 log-probs where the sequence has 5"):
        batch_invariance(capture({"all together": short}, SAMPLED, SAMPLED_LP))


def test_the_decode_reference_is_not_a_row_and_a_missing_one_is_an_error():
    cap = capture({"all together": ALONE}, SAMPLED, SAMPLED_LP)
    names = [r["composition"] for r in batch_invariance(cap)["rows"]]
    assert names == ["all together", "decoded together"]
    cap["batch_check"]["runs"] = [r for r in cap["batch_check"]["runs"] if r["name"] != "decoded alone (greedy)"]
    with pytest.raises(CaptureError, match="names a reference run 'decoded alone"):
        batch_invariance(cap)


def test_a_run_missing_a_sequence_is_an_error():
    with pytest.raises(CaptureError, match="holds 1 sequences, the capture 2"):
        batch_invariance(capture({"all together": ALONE[:1]}, SAMPLED, SAMPLED_LP))


def test_a_capture_without_a_batch_check_says_how_to_make_one():
    cap = capture({}, SAMPLED, SAMPLED_LP)
    del cap["batch_check"]
    with pytest.raises(CaptureError, match="--batch-check"):
        batch_invariance(cap)


def test_every_composition_scores_every_sequence_once():
    for name, calls in batch_compositions(3):
        seen = sorted(i for call in calls for i in call if i >= 0)
        assert seen == [0, 1, 2], name
    # and at least one composition shares a forward between different sequences
    assert any(len([i for i in call if i >= 0]) > 1 for _, calls in batch_compositions(3) for call in calls)


@pytest.fixture(scope="module")
def trainer_capture(tmp_path_factory):
    """The trainer as the engine (capture_from_trainer), with a batch check in which the reversed batch
    moved one log-prob by one FP32 ulp."""
    model = tiny_model("qwen2", seed=0).eval()
    cap = capture_from_trainer(model, None, prompts=2)
    alone = [[float(x) for x in s["prompt_logprobs"][1:]] for s in cap["sequences"]]
    moved = [list(a) for a in alone]
    moved[0][2] = one_ulp_up(moved[0][2])
    runs = [dict(name="all together", kind="prefill", calls=[[0, 1]], logprobs=alone, forward_tokens=[99]),
            dict(name="all together, reversed", kind="prefill", calls=[[1, 0]], logprobs=moved, forward_tokens=[99])]
    f = tmp_path_factory.mktemp("bc") / "cap.pt"
    torch.save(dict(cap, batch_check=dict(max_num_seqs=2, prefix_caching=False, runs=runs)), f)
    plain = f.with_name("plain.pt")
    torch.save(cap, plain)
    return f, plain


def test_mismatch_with_the_batch_check_reports_it_and_warns(trainer_capture):
    f, _ = trainer_capture
    rep = run_mismatch("vllm", family="qwen2", profile=TRAINER, capture_file=str(f), batch_check=True)
    assert rep.batch_check["batch_invariant"] is False
    assert any("change with the batch: all together, reversed" in w for w in rep.warnings), rep.warnings
    assert rep.as_dict()["batch_check"]["rows"][1]["equal"] == rep.as_dict()["batch_check"]["rows"][1]["tokens"] - 1
    # without --batch-check nothing of it is reported
    rep = run_mismatch("vllm", family="qwen2", profile=TRAINER, capture_file=str(f))
    assert rep.batch_check is None and "batch_check" not in rep.as_dict()


def test_batch_check_of_a_capture_made_without_it_is_refused(trainer_capture):
    _, plain = trainer_capture
    with pytest.raises(EngineProfilesError, match="holds no batch check: capture it with --batch-check"):
        run_mismatch("vllm", family="qwen2", profile=TRAINER, capture_file=str(plain), batch_check=True)


def test_cli_prints_the_verdict_and_writes_it_to_the_json(trainer_capture, tmp_path):
    from engineloop.cli import app

    f, _ = trainer_capture
    js = tmp_path / "m.json"
    r = CliRunner().invoke(app, ["mismatch", "vllm", "--capture", str(f), "--profile", TRAINER, "--batch-check",
                                 "--json", str(js)])
    assert r.exit_code == 0, r.output
    assert "engine batch-invariant: NO" in r.output and "all together, reversed" in r.output
    d = json.loads(js.read_text())
    assert d["batch_check"]["batch_invariant"] is False and len(d["batch_check"]["rows"]) == 2
    # a saved result with a batch check still loads for `probe-engine plot`
    from engineloop.tables import load_mismatch

    assert load_mismatch(str(js)).batch_check["batch_invariant"] is False
