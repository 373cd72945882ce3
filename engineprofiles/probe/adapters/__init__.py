"""Engine adapters. Each imports its engine lazily, so this package imports anywhere; which class is an
engine's adapter is its record's ``adapter`` (engineprofiles.engines)."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

from ... import engines

if TYPE_CHECKING:  # torch is loaded by the process that probes, not by one that hands over
    import torch

    from ..base import Adapter


def make_adapter(engine: str, mode: str, dtype: torch.dtype, device: str, model: str | None = None) -> Adapter:
    """The adapter of ``engine`` in ``mode`` (``model``: the family, for an adapter that builds the
    family's own modules, as transformers' does)."""
    cls = engines.get(engine).load("adapter")
    kwargs = dict(mode=mode, dtype=dtype, device=device)
    if "family" in inspect.signature(cls).parameters:
        kwargs["family"] = model
    return cls(**kwargs)
