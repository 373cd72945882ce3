"""Runs INSIDE vLLM's environment (tests/engines/test_rope_scaling_engine.py): build vLLM's own rotary
embedding for each RoPE scaling case with FP32 cache (get_rope, as its models do) and compare its
cos/sin cache and inverse frequencies bitwise with engineprofiles.regions.RopeFrequencies. Prints one
JSON line per case."""

from __future__ import annotations

import json
import sys

import torch


def main() -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from engineprofiles.regions import RopeFrequencies

    cases = json.loads(sys.argv[1])
    with set_current_vllm_config(VllmConfig()):
        for case in cases:
            params, head_dim, max_pos = case["params"], case["head_dim"], case["max_position"]
            rot = get_rope(head_dim, max_pos, True, dict(params), torch.float32)
            cache = rot.cos_sin_cache
            f = RopeFrequencies.from_parameters(head_dim, params)
            hf = RopeFrequencies.from_parameters(head_dim, params, linear_scales="frequency")
            pos = torch.arange(cache.shape[0])
            mine = torch.cat(f.cos_sin(pos), dim=-1)
            hf_style = torch.cat(hf.cos_sin(pos), dim=-1)
            print(json.dumps(dict(
                case=case, engine_class=type(rot).__name__, positions=int(cache.shape[0]),
                inv_freq_equal=bool(torch.equal(rot._compute_inv_freq(rot.base), f.inv_freq())),
                cache_mismatches=int((cache != mine).sum()), cache_elements=int(cache.numel()),
                hf_convention_mismatches=int((cache != hf_style).sum()),
            )), flush=True)


if __name__ == "__main__":
    main()
