"""Runs INSIDE an engine's environment (tests/engines/test_rope_scaling_engine.py): build the engine's own
rotary embedding for each RoPE case with an FP32 cache (its get_rope, as its models do) and save the
cos/sin cache, the class and the inverse frequencies to OUTDIR/case<i>.pt, for the trainer's side to
compare with what it computes.

    python -m tests.engines.rope_cache_worker vllm|sglang CASES_JSON OUTDIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def _vllm(cases: list[dict], out: Path) -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        for i, c in enumerate(cases):
            rot = get_rope(c["head_dim"], c["max_position"], True, dict(c["params"]), torch.float32)
            _save(out / f"case{i}.pt", rot, _inv_freq(rot))


def _inv_freq(rot) -> torch.Tensor:
    # The engines' _compute_inv_freq takes the base, except YaRN's, which takes its scaling factor.
    return rot._compute_inv_freq(rot.scaling_factor if "YaRN" in type(rot).__name__ else rot.base)


def _sglang(cases: list[dict], out: Path) -> None:
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from sglang.srt.layers.rotary_embedding.factory import get_rope

    for i, c in enumerate(cases):
        p = c["params"]
        rot = get_rope(c["head_dim"], c["head_dim"], c["max_position"], p["rope_theta"], True,
                       rope_scaling=dict(p), dtype=torch.float32)
        _save(out / f"case{i}.pt", rot, _inv_freq(rot))


def _save(path: Path, rot, inv_freq: torch.Tensor) -> None:
    torch.save(dict(cache=rot.cos_sin_cache.float().contiguous(), inv_freq=inv_freq.float(), cls=type(rot).__name__,
                    torch_version=str(torch.__version__)), path)


def main() -> None:
    engine, cases, out = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    {"vllm": _vllm, "sglang": _sglang}[engine](cases, out)
    print(f"saved {len(cases)} caches", flush=True)


if __name__ == "__main__":
    main()
