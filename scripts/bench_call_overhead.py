#!/usr/bin/env python
"""What one patched region call costs in Python, beside the arithmetic: the public API
(emulator.functional, which the patched forwards call with the point resolved once at apply time)
against the autograd Function it wraps and against the bare forward computation, measured side
by side in one run.

    .venv/bin/python scripts/bench_call_overhead.py [--profile NAME] [--tokens 1] [--calls 2000]

For each region, on one token of Qwen2.5-0.5B's widths (so the arithmetic is small and the
overhead shows), three ways to compute the same forward, interleaved in rounds so that machine
load hits all alike; the numbers are medians over rounds of the mean time per call:

  api        F.rope / F.swiglu / F.rmsnorm / F.add_rmsnorm with a Point, inputs requiring grad
             (the patched model's call: argument checks, point and dtype, backend, autograd)
  function   the autograd Function alone (what api calls after its checks), inputs requiring grad
  forward    the forward computation alone (no checks, no autograd)

api - forward is the Python overhead of one patched region call; api - function is the part of
it that is the API's own checking. Each call's output is checked bit-equal across the three.
Times are this machine's; the differences, measured in one run, are what to compare.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from emulator import functional as F
from emulator.ops.rmsnorm import AddRMSNormFunction, RMSNormFunction, add_rmsnorm_forward, rmsnorm_forward
from emulator.ops.rope import RoPEFunction, rope_forward
from emulator.ops.swiglu import SwiGLUFunction, swiglu_forward
from engineprofiles.models import QWEN25_05B_WIDTHS
from engineprofiles.regions import rope_cos_sin
from engineprofiles.rounding import ACT_DTYPES
from engineprofiles.store import get_profile


def cases(prof, tokens: int):
    act = ACT_DTYPES[prof.dtype]
    w = QWEN25_05B_WIDTHS
    hidden, inter, heads, hd = w["hidden_size"], w["intermediate_size"], w["num_attention_heads"], w["head_dim"]
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, dtype=act):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_(dtype != torch.float32)

    backend = F.current_backend() if F.current_backend() != "auto" else "reference"
    pr, ps, pn, pa = (prof.point(r) for r in ("rope", "swiglu", "rmsnorm", "add_rmsnorm"))
    x = rnd(tokens, heads, hd)
    cos, sin = rope_cos_sin(torch.arange(tokens), hd, 1e6)
    cs3, sn3 = cos.float().reshape(tokens, 1, hd // 2), sin.float().reshape(tokens, 1, hd // 2)
    gate, up = rnd(tokens, inter), rnd(tokens, inter)
    h, r, wt = rnd(tokens, hidden), rnd(tokens, hidden), rnd(hidden)
    eps = 1e-6
    return {
        "rope": (
            lambda: F.rope(x, cos, sin, pr, style="neox", dtype=act),
            lambda: RoPEFunction.apply(x, cs3, sn3, pr, "neox", act, backend),
            lambda: rope_forward(x.detach(), cs3, sn3, pr, "neox", act, backend),
        ),
        "swiglu": (
            lambda: F.swiglu(gate, up, ps, dtype=act),
            lambda: SwiGLUFunction.apply(gate, up, ps, act, backend),
            lambda: swiglu_forward(gate.detach(), up.detach(), ps, act, backend),
        ),
        "rmsnorm": (
            lambda: F.rmsnorm(h, wt, eps, pn, dtype=act),
            lambda: RMSNormFunction.apply(h, wt, eps, pn, act, backend),
            lambda: rmsnorm_forward(h.detach(), wt.detach(), eps, pn, act, backend),
        ),
        "add_rmsnorm": (
            lambda: F.add_rmsnorm(h, r, wt, eps, pa, dtype=act)[0],
            lambda: AddRMSNormFunction.apply(h, r, wt, eps, pa, act, backend)[0],
            lambda: add_rmsnorm_forward(h.detach(), r.detach(), wt.detach(), eps, pa, act, backend)[0],
        ),
    }


def per_call(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="vllm-0.32.0-cpu-inductor-bfloat16")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--calls", type=int, default=2000, help="calls per round and way")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if min(args.tokens, args.calls, args.rounds) < 1:
        ap.error("--tokens, --calls and --rounds must be positive")
    torch.set_num_threads(1)
    prof = get_profile(args.profile)
    print(f"profile {prof.canonical_name}; {args.tokens} token(s) of Qwen2.5-0.5B widths; backend "
          f"{F.current_backend()}; torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}); "
          f"{args.rounds} rounds x {args.calls} calls, 1 thread")
    print(f"{'region':<12} {'api us':>8} {'function us':>12} {'forward us':>11} {'overhead us':>12} {'of it checks us':>16}")
    for region, ways in cases(prof, args.tokens).items():
        outs = [w() for w in ways]
        if not all(torch.equal(o.detach().view(torch.int16) if o.dtype != torch.float32 else o.detach(),
                               outs[0].detach().view(torch.int16) if outs[0].dtype != torch.float32 else outs[0].detach())
                   for o in outs):
            print(f"{region}: the three ways disagree; not timed")
            return 1
        for w in ways:  # warm-up
            per_call(w, max(1, args.calls // 10))
        rounds = [[per_call(w, args.calls) for w in ways] for _ in range(args.rounds)]
        api, fun, fwd = (statistics.median(r[i] for r in rounds) * 1e6 for i in range(3))
        print(f"{region:<12} {api:8.1f} {fun:12.1f} {fwd:11.1f} {api - fwd:12.1f} {api - fun:16.1f}")
    # The floor on this machine, measured the same way: what any Python-level region call pays
    # before it computes anything (an autograd Function that returns its input; one tensor view).
    x = torch.randn(8, requires_grad=True)
    floor = {"identity autograd Function": lambda: _Identity.apply(x), "one tensor view": lambda: x.view(8)}
    for w in floor.values():
        per_call(w, max(1, args.calls // 10))
    rounds = [[per_call(w, args.calls) for w in floor.values()] for _ in range(args.rounds)]
    print("floor: " + "; ".join(f"{name} {statistics.median(r[i] for r in rounds) * 1e6:.1f} us"
                                for i, name in enumerate(floor)))
    return 0


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


if __name__ == "__main__":
    raise SystemExit(main())
