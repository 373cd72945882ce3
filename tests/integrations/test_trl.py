"""TRL (issue 33): three GRPO steps in TRL's own environment (scripts/framework_env.sh trl 1.13.0) with the
documented one-liner and log_mismatch, and log_mismatch's refusals and masking without TRL."""

from __future__ import annotations

import json
import math
import subprocess
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engineloop.integrations.trl import TRLIntegrationError, log_mismatch
from engineprofiles.metrics import rollout_corr

REPO = Path(__file__).resolve().parents[2]
TRL_VERSION = "1.13.0"
METRICS = ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/ppl_ratio", "mismatch/exact_match",
           "mismatch/abs_dlogp_max")


def test_three_grpo_steps_in_trl_log_the_mismatch_metrics_and_patch_policy_and_reference(tmp_path):
    env = REPO / ".frameworks" / f"trl-{TRL_VERSION}"
    if not (env / ".ready").exists():
        pytest.fail(f"TRL's environment is missing: run `scripts/framework_env.sh trl {TRL_VERSION}` (scripts/test.sh "
                    "does this). Framework tests are not skipped.", pytrace=False)
    run = subprocess.run([str(env / "bin" / "python"), str(Path(__file__).with_name("trl_worker.py")), str(tmp_path)],
                         capture_output=True, text=True, timeout=900, cwd=REPO)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["global_step"] == 3
    # The class patch made before the trainer loaded its models reaches the policy and TRL's reference model.
    assert r["patched"] == {"policy": True, "reference": True}
    assert r["emulated"], "the policy's patch emulates no region"
    steps = [h for h in r["log_history"] if "loss" in h]
    assert [h["step"] for h in steps] == [1, 2, 3]
    for h in steps:  # every step's log holds the metrics, finite
        for name in METRICS:
            assert name in h and math.isfinite(h[name]), (h["step"], name)
    # What log_mismatch recorded is the metrics of the engine's log-probs against the trainer's, recomputed by a
    # plain forward (TRL's own function batches differently, hence the tolerance: a plumbing check, not a rounding
    # claim); one generation batch per step.
    assert len(r["batches"]) == 3
    for b, h in zip(r["batches"], steps):
        got, want = b["logged"], b["recomputed"]
        assert got["mismatch/tokens"] == want["mismatch/tokens"] == 32  # 4 completions of 8 tokens
        for name in METRICS:
            assert abs(got[name] - want[name]) <= 1e-6 * max(1.0, abs(want[name])), name
            assert h[name] == pytest.approx(got[name], rel=1e-6, abs=1e-12)  # what the log shows
    # A trainer sampling with the model it trains has no engine log-probs: refused, saying what to do.
    assert r["refusal"] and "use_vllm=True" in r["refusal"] and "rollout_func" in r["refusal"]


class FakeGRPO:
    """What log_mismatch reads of TRL's GRPOTrainer: its generation step, metrics and callbacks."""

    def __init__(self, output, use_vllm=True, rollout_func=None):
        self.output, self.use_vllm, self.rollout_func = output, use_vllm, rollout_func
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self.model = torch.nn.Linear(1, 1).train()
        self.callbacks = []

    def _generate_and_score_completions(self, inputs):
        return self.output

    def add_callback(self, cb):
        self.callbacks.append(cb)

    def remove_callback(self, cb):
        self.callbacks.remove(cb)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    train = -torch.rand(3, 6, generator=g) * 4
    engine = train + torch.randn(3, 6, generator=g) * 1e-3
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4])
    return {"prompt_ids": torch.zeros(3, 2, dtype=torch.long), "completion_mask": mask,
            "sampling_per_token_logps": engine, "old_per_token_logps": train}


def test_log_mismatch_records_the_batch_metrics_leaving_out_tool_tokens_and_nan_engine_logprobs():
    out = batch()
    out["tool_mask"] = torch.ones(3, 6, dtype=torch.long)
    out["tool_mask"][0, 3] = 0                    # a tool's token: not the model's
    out["sampling_per_token_logps"][1, 0] = float("nan")  # a token vLLM could not score
    out["sampling_per_token_logps"][2, 5] = float("nan")  # padding: never read
    trainer = FakeGRPO(out)
    cb = log_mismatch(trainer)
    assert trainer.callbacks == [cb]
    assert trainer._generate_and_score_completions([]) is out
    mask = out["completion_mask"].bool() & out["tool_mask"].bool()
    mask[1, 0] = False
    want = rollout_corr(out["sampling_per_token_logps"], out["old_per_token_logps"], mask)
    assert cb.last == want and want["mismatch/tokens"] == 10
    assert {k: v for k, v in trainer._metrics["train"].items()} == {k: [v] for k, v in want.items()}
    cb.on_train_end(None, None, None)  # a second train() call still logs
    assert trainer._generate_and_score_completions([]) is out and cb.batches == 2
    cb.remove()  # the trainer's own generation step back, the callback gone
    assert "_generate_and_score_completions" not in trainer.__dict__ and not trainer.callbacks
    assert trainer._generate_and_score_completions([]) is out and cb.batches == 2


@pytest.mark.parametrize("case", ["own sampling", "no engine logprobs", "not grpo", "twice", "bad threshold"])
def test_log_mismatch_refuses_what_it_cannot_measure(case):
    out = batch()
    trainer = FakeGRPO(out, use_vllm=case != "own sampling")
    if case == "not grpo":
        trainer = SimpleNamespace(use_vllm=True)
    with pytest.raises((TRLIntegrationError, ValueError)) as e:
        if case == "no engine logprobs":
            del out["sampling_per_token_logps"]
            log_mismatch(trainer)
            trainer._generate_and_score_completions([])
        elif case == "twice":
            log_mismatch(trainer)
            log_mismatch(trainer)
        elif case == "bad threshold":
            log_mismatch(trainer, is_threshold=0.5)
        else:
            log_mismatch(trainer)
    assert str(e.value)
    if case == "bad threshold":
        assert "_generate_and_score_completions" not in trainer.__dict__ and not trainer.callbacks
