"""RoPE scaling against the real engines: vLLM's and SGLang's own rotary embeddings (their get_rope, as
their models build them; each in its own environment and torch) hold exactly the FP32 cos/sin cache
that engineprofiles.regions.RopeFrequencies computes here, in the trainer's torch (what the patched
trainer rotates by), for llama3, linear and YaRN scaling (YaRN's attention factor folded into the cache); and under linear scaling HF's convention (the
frequency divided, not the position) would not. A missing engine environment is a failure, never a
skip."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from engineprofiles.regions import RopeFrequencies

from .envs import REPO, require_env

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
    # YaRN: the tiny models' (factor 4 over 10240), Qwen2.5's long-context setting (factor 4 over 32768), and
    # explicit betas with an attention factor given
    dict(params=dict(rope_type="yarn", rope_theta=500000.0, factor=4.0, original_max_position_embeddings=10240),
         head_dim=64, max_position=40960),
    dict(params=dict(rope_type="yarn", rope_theta=1000000.0, factor=4.0, original_max_position_embeddings=32768),
         head_dim=128, max_position=131072),
    dict(params=dict(rope_type="yarn", rope_theta=10000.0, factor=2.5, original_max_position_embeddings=2048,
                     beta_fast=16, beta_slow=2, attention_factor=1.25), head_dim=64, max_position=5120),
    # dynamic (NTK): each engine's fixed base (vLLM: the plain base unless max_trained_positions is given)
    dict(params=dict(rope_type="dynamic", rope_theta=500000.0, factor=2.0), head_dim=64, max_position=4096),
    dict(params=dict(rope_type="dynamic", rope_theta=10000.0, factor=3.0, max_trained_positions=2048), head_dim=128,
         max_position=4096),
]
CLASSES = {"llama3": "Llama3RotaryEmbedding", "linear": "LinearScalingRotaryEmbedding", "default": "RotaryEmbedding",
           "yarn": "YaRNScalingRotaryEmbedding", "dynamic": "DynamicNTKScalingRotaryEmbedding"}


@pytest.mark.engine
@pytest.mark.parametrize("engine,version", [("vllm", "0.32.0"), ("sglang", "0.5.23")])
def test_the_engines_rotary_cache_is_ropefrequencies_bit_for_bit(engine, version, tmp_path):
    env = require_env(engine, version)
    r = subprocess.run([str(env / "bin" / "python"), "-m", "tests.engines.rope_cache_worker", engine,
                        json.dumps(CASES), str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    for i, case in enumerate(CASES):
        got = torch.load(tmp_path / f"case{i}.pt")
        kind, what = case["params"]["rope_type"], f"{engine} {case}"
        assert got["cls"] == CLASSES[kind], what
        f = RopeFrequencies.from_parameters(case["head_dim"], case["params"], dynamic=engine,
                                            max_position_embeddings=case["max_position"])
        cache = got["cache"]
        assert cache.dtype == torch.float32 and cache.shape[1] == case["head_dim"], what
        if kind != "dynamic":  # (a dynamic class's _compute_inv_freq(base) is not its cache's: the cache is checked)
            assert torch.equal(got["inv_freq"], f.inv_freq()), what
        mine = torch.cat(f.cos_sin(torch.arange(cache.shape[0])), dim=-1)
        bad = int((cache != mine).sum())
        if engine == "sglang" and "attention_factor" in case["params"]:
            # SGLang 0.5.23 ignores YaRN's attention_factor: its factor's own mscale, which the trainer
            # follows for an SGLang profile (RopeFrequencies(attention_factor=False))
            assert bad > 0, what
            f = RopeFrequencies.from_parameters(case["head_dim"], case["params"], attention_factor=False)
            mine = torch.cat(f.cos_sin(torch.arange(cache.shape[0])), dim=-1)
            bad = int((cache != mine).sum())
        assert bad == 0, f"{what}: {bad} of {cache.numel()} cos/sin values differ"
        if kind == "linear":  # the engine scales the position; HF's convention rounds otherwise
            hf = RopeFrequencies.from_parameters(case["head_dim"], case["params"], linear_scales="frequency")
            assert not torch.equal(cache, torch.cat(hf.cos_sin(torch.arange(cache.shape[0])), dim=-1)), what
