"""What an engine adapter gives the probe: the engine's own implementation of each region.

An adapter is engine-specific (it imports the engine lazily, inside its own environment); the
harness is not. Each region implementation is a plain callable on activation-dtype tensors:

* ``rope(positions[T], q[T, Hq, D], k[T, Hk, D], *, base, style) -> (q_out, k_out)``
* ``swiglu(gate[T, I], up[T, I]) -> out``
* ``rmsnorm(x[T, H], weight[H], eps) -> out``
* ``add_rmsnorm(x[T, H], residual[T, H], weight[H], eps) -> (out, residual_out)``

A region the engine cannot run on this device is an :class:`Unavailable` with the reason.

``attention()`` gives the engine's attention the same way (what exact mode consumes), as
``attention(q[Tq, Hq, D], k[Tk, Hk, D], v[Tk, Hk, D], *, scale) -> out[Tq, Hq, D]``: causal, the
queries being the last Tq of the Tk positions of one sequence. ``moe()`` gives the experts of a
sparse MoE block (see :meth:`Adapter.moe`), ``shared_expert()`` its shared expert.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import EngineProfilesError


class Unavailable(EngineProfilesError):
    """The engine cannot run this region (or this shape) here; the message says why."""


class EngineNotInstalled(EngineProfilesError):
    pass


@dataclass
class RegionImpl:
    fn: Callable[..., Any]
    path: str  # the engine code path, e.g. "vllm RMSNorm.forward_native via torch.compile(inductor)"
    notes: list[str] = field(default_factory=list)
    # what the engine picked to run it that decides the bits (engine.settings entries once probed:
    # vLLM's attention records the kernel's ISA, which exact mode's engine kernels check)
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class EngineInfo:
    name: str
    version: str
    backend: str
    device: str
    torch_version: str
    execution_mode: str
    settings: dict[str, Any] = field(default_factory=dict)


class Adapter:
    """Base class of engine adapters."""

    name = "engine"
    modes: tuple[str, ...] = ("default",)

    def info(self) -> EngineInfo:
        raise NotImplementedError

    def regions(self) -> dict[str, RegionImpl | Unavailable]:
        raise NotImplementedError

    def attention(self) -> RegionImpl | Unavailable:
        return Unavailable(f"attention is not probed op-level for {self.name}")

    def moe(self) -> RegionImpl | Unavailable:
        """The engine's sparse MoE block as it runs it by default on this device, from the router's
        logits on (its router, then its experts): ``moe(x[T, H], w13[E, 2I, H], w2[E, H, I],
        router_logits[T, E] (activation dtype), topk: int, *, renormalize: bool) -> out[T, H]``, the top-k
        weights renormalized or not (Qwen3-MoE's and Qwen2-MoE's ``norm_topk_prob``)."""
        return Unavailable(f"{self.name} has no MoE experts probe")

    def shared_expert(self) -> RegionImpl | Unavailable:
        """The engine's MoE shared expert (Qwen2-MoE) as it runs it by default on this device, and
        its sum with the routed output, seen in the residual stream after the next residual add:
        ``shared_expert(x[T, H], w_gate_up[2I, H], w_down[H, I], w_gate[1, H], routed[T, H],
        residual[T, H]) -> residual'[T, H]``, all in the activation dtype (``routed``: the routed
        experts' output)."""
        return Unavailable(f"{self.name} has no MoE shared expert probe")

    def attention_cases(self) -> tuple[tuple, ...]:
        """Attention probe cases on top of :data:`attention.ATTENTION_CASES` (same tuple layout), where
        this engine's kernel has choices the standard cases cannot tell apart; none by default."""
        return ()

    def sweep(self, region: str) -> list[dict[str, Any]] | None:
        """Shapes to probe ``region`` at, when the engine fixes some dims (a given model); None
        means the standard sweep."""
        return None
