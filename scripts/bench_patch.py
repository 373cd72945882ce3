#!/usr/bin/env python
"""What emulator.apply_profile costs: forward + backward time of a patched model against the same
model unpatched, on this machine's CPU, measured in one run.

    .venv/bin/python scripts/bench_patch.py [--profile NAME ...] [--tokens 512] [--repeats 5]

The model has Qwen2.5-0.5B's widths (hidden 896, MLP 4864, 14 heads, 2 KV heads, head_dim 64) with
2 decoder layers and a 256-token vocabulary (so the LM head does not hide the layers). Runs are
interleaved (unpatched, patched, unpatched, ...) after a warm-up, so a change in machine load hits
both alike; the ratio is of the medians. On CPU the emulator runs the torch reference of each
region (FP32 math, explicit rounding), so the cost is that of the reference, not of the Triton
kernels a GPU uses. Where BF16 matrix multiplies are slow (an AVX2 CPU without native BF16: the
backward's BF16 GEMMs take most of a step), the ratio is close to 1 whatever the regions cost;
the absolute differences printed with it are then the better measure.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from emulator import apply_profile
from engineprofiles.models import QWEN25_05B_WIDTHS, tiny_inputs, tiny_model
from engineprofiles.store import get_profile


def step(model, ids) -> tuple[float, float]:
    """(forward, backward) seconds of one training step."""
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    out = model(ids, labels=ids)
    t1 = time.perf_counter()
    out.loss.backward()
    return t1 - t0, time.perf_counter() - t1


def med(xs: list[tuple[float, float]], i: int | None = None) -> float:
    return statistics.median(x[i] if i is not None else sum(x) for x in xs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", action="append", help="profile(s) to apply (default: vllm-0.32.0 inductor)")
    ap.add_argument("--family", default="qwen2")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--emulate-native", action="store_true",
                    help="also measure skip_native=False (the emulator in every region)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.profile or ["vllm-0.32.0-cpu-inductor-bfloat16"]
    model = tiny_model(args.family, num_hidden_layers=2, **QWEN25_05B_WIDTHS)
    model.train()
    ids = tiny_inputs(model, args.tokens)
    print(f"{args.family}, Qwen2.5-0.5B widths, 2 layers, {args.tokens} tokens, bf16, CPU ({torch.get_num_threads()} "
          f"threads, torch {torch.__version__}); forward + backward, median of {args.repeats}", flush=True)
    print(f"{'profile':<52} {'emulated':<34} {'unpatched':>10} {'patched':>10} {'ratio':>6}  "
          "(fwd / bwd ratio; patched - unpatched, fwd / bwd)")
    for name in names:
        prof = get_profile(name)
        for skip_native in (True, False) if args.emulate_native else (True,):
            handle = apply_profile(model, prof, skip_native=skip_native)
            handle.remove()
            base: list[tuple[float, float]] = []
            patched: list[tuple[float, float]] = []
            step(model, ids)  # warm-up, both ways
            with apply_profile(model, prof, skip_native=skip_native):
                step(model, ids)
            for _ in range(args.repeats):
                base.append(step(model, ids))
                with apply_profile(model, prof, skip_native=skip_native):
                    patched.append(step(model, ids))
            b, p = med(base), med(patched)
            label = name + ("" if skip_native else " (skip_native=False)")
            print(f"{label:<52} {', '.join(handle.emulated) or '-':<34} {b:>9.2f}s {p:>9.2f}s {p / b:>6.3f}  "
                  f"({med(patched, 0) / med(base, 0):.2f} / {med(patched, 1) / med(base, 1):.2f}; "
                  f"{med(patched, 0) - med(base, 0):+.2f}s / {med(patched, 1) - med(base, 1):+.2f}s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
