"""The residual stream between patched decoder layers.

Engines fuse each residual add into the next norm, so a patched layer needs the previous layer's
(MLP output, residual) pair, not their sum; HF's decoder loop passes one tensor. Each patched layer
returns ``h = m + residual`` and puts ``(m, residual)`` in a per-model :class:`Stash` keyed by
where ``h`` lives; the next layer looks it up, and :class:`Carry` hands the pair on as values
while the gradient flows through ``h``.
"""

from __future__ import annotations

from typing import Any

import torch


def _storage_ref(t: torch.Tensor):
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


class Stash:
    """(MLP output, residual) of each patched layer's output ``h``, found again by where ``h``
    lives. An entry is valid while ``h``'s storage is alive (so it cannot match a tensor that
    reuses the memory later), and is dropped once that storage is freed.

    Under torch.compile, where a tensor has no storage to look at, the pair travels in ``last``
    instead and is found by identity (the tensor object the previous layer returned): tracing
    sees that the next layer gets exactly the previous layer's output. A layer whose input comes
    from outside the compiled code (a layer compiled alone) looks it up where it lives, outside the
    compiled graph (a graph break)."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self.last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def _key(t: torch.Tensor) -> tuple:
        return (t.device, t.dtype, t.data_ptr(), tuple(t.shape), t.stride())

    def put(self, h: torch.Tensor, m: torch.Tensor, residual: torch.Tensor) -> None:
        if torch.compiler.is_compiling():
            self.last = (h, m, residual)
            return
        self.purge()
        self._entries[self._key(h)] = (_storage_ref(h), m, residual)

    def get(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        last = self.last
        if last is not None and last[0] is t:
            return last[1], last[2]
        if torch.compiler.is_compiling():
            return _lookup_outside_compile(self, t)
        return self._lookup(t)

    def _lookup(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        e = self._entries.get(self._key(t))
        if e is None or e[0].expired() or e[0] != _storage_ref(t):
            return None
        return e[1], e[2]

    def purge(self) -> None:
        self.last = None
        if torch.compiler.is_compiling():
            return
        for k in [k for k, e in self._entries.items() if e[0].expired()]:
            del self._entries[k]

    def clear(self) -> None:
        self._entries.clear()
        self.last = None

    def __len__(self) -> int:
        return len(self._entries)


@torch.compiler.disable
def _lookup_outside_compile(stash: Stash, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The pair of ``t``, looked up where it lives (run outside the compiled graph: a graph break).
    ``t`` may be the previous layer's output re-wrapped by a hook that torch.compile does not trace
    (FSDP2's), so ``last`` is matched like the stash's entries, by where the tensor lives."""
    last = stash.last
    if last is not None and Stash._key(last[0]) == Stash._key(t) and _storage_ref(last[0]) == _storage_ref(t):
        return last[1], last[2]
    return stash._lookup(t)


class Carry(torch.autograd.Function):
    """Hand the stashed (m, residual) on as values while the gradient flows through ``h``.

    ``h = m + residual`` is what the previous layer returned; the next region is
    ``add_rmsnorm(m, residual)``, whose backward gives both inputs the gradient of their FP32 sum
    s (straight-through). So the gradient of h is that of the residual input (in h's dtype,
    which is the residual's), and autograd carries it from h back to m and the residual."""

    @staticmethod
    def forward(ctx, h, pair):  # type: ignore[override]
        m, residual = pair
        return m.detach(), residual.detach()

    @staticmethod
    def backward(ctx, dm, dresidual):  # type: ignore[override]
        return dresidual, None
