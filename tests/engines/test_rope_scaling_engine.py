"""RoPE scaling against the real vLLM: the engine's own rotary embedding (get_rope, as its models
build it) computes exactly the FP32 cos/sin that engineprofiles.regions.RopeFrequencies computes
(what the patched trainer rotates by), for llama3 and linear scaling; and under linear scaling HF's
convention (the frequency divided, not the position) would not. A missing engine environment is a
failure, never a skip."""

from __future__ import annotations

import json
import subprocess

import pytest

from .envs import REPO, require_env

VERSION = "0.32.0"
LLAMA31 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8192)
CASES = [
    dict(params=LLAMA31, head_dim=64, max_position=40960),
    dict(params=LLAMA31, head_dim=128, max_position=16384),
    dict(params=dict(rope_type="llama3", rope_theta=10000.0, factor=3.0, low_freq_factor=1.5, high_freq_factor=5.0,
                     original_max_position_embeddings=512), head_dim=64, max_position=4096),
    dict(params=dict(rope_type="linear", rope_theta=500000.0, factor=3.0), head_dim=64, max_position=4096),
    dict(params=dict(rope_type="linear", rope_theta=10000.0, factor=2.5), head_dim=128, max_position=4096),
    dict(params=dict(rope_type="default", rope_theta=1000000.0), head_dim=64, max_position=4096),
]


@pytest.mark.engine
def test_vllms_rotary_cache_is_ropefrequencies_bit_for_bit():
    env = require_env("vllm", VERSION)
    r = subprocess.run([str(env / "bin" / "python"), "-m", "tests.engines.rope_cache_worker", json.dumps(CASES)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [row["case"] for row in rows] == CASES
    for row in rows:
        what = f"{row['case']['params']['rope_type']} {row['case']}"
        kind = row["case"]["params"]["rope_type"]
        assert row["engine_class"] == {"llama3": "Llama3RotaryEmbedding", "linear": "LinearScalingRotaryEmbedding",
                                       "default": "RotaryEmbedding"}[kind], what
        assert row["inv_freq_equal"], what
        assert row["cache_mismatches"] == 0, f"{what}: {row['cache_mismatches']} of {row['cache_elements']} differ"
        if kind == "linear":  # the engine scales the position; HF's convention rounds otherwise
            assert row["hf_convention_mismatches"] > 0, what
