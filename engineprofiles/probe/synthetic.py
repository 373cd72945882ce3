"""Synthetic engines built from the reference, to test the probe itself.

A synthetic engine computes each region at a chosen lattice point, optionally with a planted
defect: a different point for larger shapes (shape dependence), a random bit flip on every call
(nondeterminism), or an output mixed from two points so that both match equally (ambiguity).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from ..regions import REGIONS, Point
from .base import Adapter, EngineInfo, RegionImpl, Unavailable
from .harness import reference_outputs


def _rope_inputs(positions, q, k, base, style):
    return dict(positions=positions, q=q, k=k, base=base, style=style)


class SyntheticAdapter(Adapter):
    name = "synthetic"

    def __init__(
        self,
        points: dict[str, Point],
        *,
        large_points: dict[str, Point] | None = None,
        large_tokens: int = 32,
        flip_bits: set[str] = frozenset(),
        mixed_with: dict[str, Point] | None = None,
        sweeps: dict[str, list[dict[str, Any]]] | None = None,
    ):
        self.sweeps = sweeps or {}
        self.points = points
        self.large_points = large_points or {}
        self.large_tokens = large_tokens
        self.flip_bits = set(flip_bits)
        self.mixed_with = mixed_with or {}
        self._calls = itertools.count()

    def sweep(self, region: str) -> list[dict[str, Any]] | None:
        return self.sweeps.get(region)

    def info(self) -> EngineInfo:
        return EngineInfo("synthetic", "0", "cpu", "reference", torch.__version__, "reference")

    def _run(self, region: str, inp: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        tokens = next(iter(v for v in inp.values() if isinstance(v, torch.Tensor))).shape[0]
        p = self.points[region]
        if region in self.large_points and tokens >= self.large_tokens:
            p = self.large_points[region]
        out = list(reference_outputs(region, p, inp))
        if region in self.mixed_with:
            other = reference_outputs(region, self.mixed_with[region], inp)
            for i, (a, b) in enumerate(zip(out, other)):
                diff = (a.float() != b.float()).flatten().nonzero().flatten()
                take = diff[: len(diff) // 2]  # half the differing elements from each point
                flat = a.flatten().clone()
                flat[take] = b.flatten()[take]
                if len(diff) % 2:  # an odd one out matches neither point
                    flat[diff[-1]] = float("nan")
                out[i] = flat.view(a.shape)
        if region in self.flip_bits:
            n = next(self._calls)
            o = out[0].flatten().clone()
            bits = o.view(torch.int16)
            bits[n % o.numel()] ^= 1
            out[0] = o.view(out[0].shape)
        return tuple(out)

    def regions(self) -> dict[str, RegionImpl]:
        def rope(positions, q, k, *, base, style):
            return self._run("rope", _rope_inputs(positions, q, k, base, style))

        def swiglu(gate, up):
            return self._run("swiglu", dict(gate=gate, up=up))[0]

        def rmsnorm(x, weight, eps):
            return self._run("rmsnorm", dict(x=x, weight=weight, eps=eps))[0]

        def add_rmsnorm(x, residual, weight, eps):
            return self._run("add_rmsnorm", dict(x=x, residual=residual, weight=weight, eps=eps))

        fns = dict(rope=rope, swiglu=swiglu, rmsnorm=rmsnorm, add_rmsnorm=add_rmsnorm)
        return {n: RegionImpl(fns[n], f"synthetic {self.points[n].label()}") for n in REGIONS if n in self.points}

    def moe(self) -> RegionImpl | Unavailable:
        if "moe" not in self.points:
            return super().moe()

        def moe(x, w13, w2, router_logits, topk, *, renormalize=True):
            return self._run("moe", dict(x=x, w13=w13, w2=w2, router_logits=router_logits, topk=topk,
                                         renormalize=renormalize))[0]

        return RegionImpl(moe, f"synthetic {self.points['moe'].label()}")

    def shared_expert(self) -> RegionImpl | Unavailable:
        if "shared_expert" not in self.points:
            return super().shared_expert()

        def shared_expert(x, w_gate_up, w_down, w_gate, routed, residual):
            return self._run("shared_expert", dict(x=x, w_gate_up=w_gate_up, w_down=w_down, w_gate=w_gate,
                                                   routed=routed, residual=residual))[0]

        return RegionImpl(shared_expert, f"synthetic {self.points['shared_expert'].label()}")
