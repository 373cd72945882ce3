"""A dummy engine for tests/engineprofiles/test_registration.py: the record (register()) and its adapter,
the two places an engine's op-level probe needs. Its "kernels" are the lattice's reference at POINTS,
SwiGLU with SiLU kept in FP32 (HF rounds it: the probe must find it)."""

from __future__ import annotations

import torch

from engineprofiles import engines
from engineprofiles.probe.base import EngineInfo
from engineprofiles.probe.synthetic import SyntheticAdapter
from engineprofiles.regions import REGIONS

NAME = "toy"
POINTS = {"swiglu": REGIONS["swiglu"].point(silu="fp32", silu_formula="fused")}
RECORD = engines.Engine(
    name=NAME, title="the toy engine", help="Probe the toy engine (a test's dummy).",
    modes=("default", "fused"), execution_modes={"fused": "toy-fused"}, default_mode="fused",
    mode_help="default, fused", module=__name__, distributions=("toy-engine",),
    adapter=f"{__name__}:ToyAdapter", default_version="1.0",
)


def register() -> engines.Engine:
    return engines.register(RECORD)


class ToyAdapter(SyntheticAdapter):
    name = NAME

    def __init__(self, mode: str = "default", dtype: torch.dtype = torch.bfloat16, device: str = "cpu"):
        super().__init__(POINTS)
        self.mode = mode

    def info(self) -> EngineInfo:
        return EngineInfo(NAME, "1.0", "cpu", "reference", torch.__version__, RECORD.execution_mode(self.mode))
