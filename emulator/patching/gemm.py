"""Whether this machine's linear layers give a token the same bits whatever the number of tokens.

Exact mode scores a batch (padded rows, a whole sequence in one forward) while the engine computed
each token in its own batch (a prefill, one decode step at a time). Attention is made row-exact by
the emulation; the linear layers are HF's own ``F.linear``, whose CPU kernels (oneDNN, with AMX on
machines that have it) can choose their blocking by the number of rows: then a token's bits depend
on how many tokens share the GEMM (measured on an Intel Xeon with AMX: 97.8% of rows equal at
K=1024, M=90 and 130). Exact mode measures it on this machine, for the model's own linear shapes and
weights, before it patches (:func:`row_variant_linears`), and refuses where a row differs.
"""

from __future__ import annotations

import torch

# Row counts checked: one token (a decode step), small batches, and sizes around the kernels' blocks.
ROW_COUNTS = (1, 2, 3, 8, 17, 64, 130)


def _linears(model: torch.nn.Module) -> dict[tuple, tuple[str, torch.nn.Linear]]:
    """One linear module per (in, out, bias, dtype, device) shape, the first of each, by name."""
    out: dict[tuple, tuple[str, torch.nn.Linear]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and not mod.weight.is_meta:
            key = (mod.in_features, mod.out_features, mod.bias is not None, mod.weight.dtype, mod.weight.device.type)
            out.setdefault(key, (name, mod))
    return out


def _measure(mod: torch.nn.Linear, act: torch.dtype) -> str | None:
    """None when every row of ``F.linear`` over ``M`` rows equals the same row over fewer rows, for
    every M in :data:`ROW_COUNTS`; else a description of the first difference."""
    w = mod.weight if mod.weight.dtype == act else mod.weight.to(act)
    b = None if mod.bias is None else (mod.bias if mod.bias.dtype == act else mod.bias.to(act))
    g = torch.Generator(device="cpu").manual_seed(mod.in_features * 7919 + mod.out_features)
    x = torch.randn(max(ROW_COUNTS), mod.in_features, generator=g).to(device=w.device, dtype=act)
    with torch.no_grad():
        full = torch.nn.functional.linear(x, w, b)
        for m in ROW_COUNTS[:-1]:
            part = torch.nn.functional.linear(x[:m], w, b)
            bad = (part.view(torch.int16) != full[:m].view(torch.int16)).any(dim=-1)
            if bool(bad.any()):
                return (f"{int(bad.sum())} of the first {m} rows differ when the GEMM has {max(ROW_COUNTS)} rows "
                        f"instead of {m}")
        # a row alone from the middle of the batch (a decode step against a prefill row)
        j = max(ROW_COUNTS) // 2
        alone = torch.nn.functional.linear(x[j:j + 1], w, b)
        if not torch.equal(alone.view(torch.int16), full[j:j + 1].view(torch.int16)):
            return f"row {j} alone differs from the same row among {max(ROW_COUNTS)}"
    return None


_CACHE: dict[tuple, str | None] = {}


def row_variant_linears(model: torch.nn.Module, act: torch.dtype) -> list[str]:
    """The model's linear layers (one per shape) whose output rows depend on the number of rows on
    this machine, each with what differed; empty when every row is the same whatever the batch.
    Measured once per shape, weights and CPU capability in a process."""
    cap = torch.backends.cpu.get_cpu_capability()
    out = []
    for key, (name, mod) in _linears(model).items():
        ck = (key, mod.weight.data_ptr(), mod.weight._version, cap, act)
        if ck not in _CACHE:
            _CACHE[ck] = _measure(mod, act)
        if _CACHE[ck] is not None:
            out.append(f"{name} ({mod.in_features} -> {mod.out_features}): {_CACHE[ck]}")
    return out
