"""Engine adapters. Each imports its engine lazily, so this package imports anywhere."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import EngineProfilesError

if TYPE_CHECKING:  # torch is loaded by the process that probes, not by one that hands over
    import torch

    from ..base import Adapter

ENGINES = ("vllm", "sglang", "transformers")


def make_adapter(engine: str, mode: str, dtype: torch.dtype, device: str, model: str | None = None) -> Adapter:
    if engine == "vllm":
        from .vllm import VllmAdapter

        return VllmAdapter(mode=mode, dtype=dtype, device=device)
    if engine == "sglang":
        from .sglang import SglangAdapter

        return SglangAdapter(mode=mode, dtype=dtype, device=device)
    if engine == "transformers":
        from .transformers import TransformersAdapter

        return TransformersAdapter(mode=mode, dtype=dtype, device=device, family=model)
    raise EngineProfilesError(f"unknown engine {engine!r}")
