"""`probe-engine localize` against the real vLLM engine (its own environment) on a tiny Qwen2.

In eager mode every tensor of the engine's forward is observable: the trainer as-is diverges at
some tensor of the first layer, and exact mode with the shipped profile matches every observed
tensor bit for bit; in the default (compiled) mode the tensors that cross attention's boundary,
the final hidden states and the log-probs are compared. A missing engine environment is a
failure, never a skip. Where this machine's CPU capability is not the profile's, exact mode's
bit-equality is not claimed (see test_exact_mode.py) and only the localization itself is checked.
"""

from __future__ import annotations

import pytest

from engineloop.localize import tensor_names

from .envs import machine_differences, require_env, small_run

VERSION = "0.32.0"


@pytest.mark.engine
@pytest.mark.parametrize("mode", ["eager", "default"])
def test_localize_names_the_first_divergence_and_exact_mode_has_none(mode, engine_mismatch, tmp_path):
    require_env("vllm", VERSION)
    # the default mode's engine run is test_exact_mode's qwen2 run (shared: conftest.engine_mismatch)
    d = engine_mismatch("vllm", small_run("qwen2", mode), ["--trainer", "as-is", "--trainer", "exact"],
                        tmp=tmp_path, command="localize").checked()
    as_is, exact = d["trainers"]
    names = [t["name"] for t in as_is["tensors"]]
    if mode == "eager":
        assert names == tensor_names(2) and not d["unobserved"]
    else:
        assert names == [f"L{i}.{t}" for i in range(2) for t in ("q", "k", "v", "attn_out")] + ["final_norm", "logprobs"]
        assert any("not observable" in w for w in d["warnings"])
    first = as_is["first_divergence"]
    assert first is not None and first["layer"] == 0, first
    other = machine_differences(d["profile"])
    if not other:  # another machine's profile need not fix this one's engine (the AVX512 RoPE point on AVX2: 64%)
        assert any(f["removes"] for f in as_is["fixes"]), as_is["fixes"]
    assert any("measured, not claimed" in w for w in d["warnings"]) == bool(other), d["warnings"]
    if not other:
        assert exact["first_divergence"] is None, exact["tensors"]
        assert all(t["match_rate"] == 1.0 for t in exact["tensors"])
        assert as_is["fixes"][0]["change"] == "apply the engine's profile, exact=True"
