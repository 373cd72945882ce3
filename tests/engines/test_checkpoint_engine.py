"""`probe-engine mismatch vllm --model PATH` and `localize vllm --model PATH` against the real vLLM (its own
environment) on a checkpoint folder the tool did not build: a test saves a Llama or Qwen3 of random widths from
its own config, FP32 weights (issue 33 item 3). One engine run (compiled, the default), shared by both commands.

Where this machine is the profile's, exact mode on that checkpoint reproduces every sampled and re-scored token
bit for bit and localize finds no divergence in exact mode; elsewhere exact mode is refused (checked) and the
rows without it are checked. A missing engine environment is a failure, never a skip."""

from __future__ import annotations

import pytest

from ..engineloop.test_checkpoint import user_checkpoint
from .envs import exact_refused_here, machine_differences, require_env

VERSION = "0.32.0"
SEED = 11  # the checkpoint's config and weights (head dims vLLM's CPU attention takes)


@pytest.mark.engine
def test_mismatch_and_localize_run_the_engine_on_a_users_checkpoint(engine_mismatch, tmp_path):
    require_env("vllm", VERSION)
    folder = user_checkpoint(tmp_path / "user-model", SEED, head_dims=(32, 64))
    run = ["--model", str(folder), "--prompts", "2", "--max-tokens", "12"]
    exact = not exact_refused_here("vllm", VERSION, [*run, "--exact"])
    d = engine_mismatch("vllm", run, ["--exact"] if exact else [], tmp=tmp_path).checked()
    assert d["model"]["checkpoint"] == str(folder.resolve()) and d["engine"]["name"] == "vllm"
    assert "temperature 1.0" in d["engine_logprobs"]
    rows = {k: {x["trainer"]: x for x in d[k]} for k in ("sampled", "prefill")}
    assert rows["sampled"]["as-is"]["tokens"] == 2 * 12
    if exact:
        assert not machine_differences(d["profile"])
        for k in ("sampled", "prefill"):
            ex = rows[k]["exact"]
            assert ex["exact_match"] == 1.0 and ex["abs_dlogp_max"] == 0.0, (k, ex)
    # localize from the same engine run (its capture), on the same checkpoint
    loc = engine_mismatch("vllm", run, ["--trainer", "as-is", *(["--trainer", "exact"] if exact else [])],
                          tmp=tmp_path, command="localize").checked()
    names = [t["name"] for t in loc["trainers"][0]["tensors"]]
    assert names[-2:] == ["final_norm", "logprobs"]
    if exact:
        assert loc["trainers"][1]["first_divergence"] is None, loc["trainers"][1]["tensors"]
