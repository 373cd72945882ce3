#!/usr/bin/env python
"""What exact mode costs: forward + backward time of the same model unpatched, with the profile
(apply_profile), and in exact mode (apply_profile(..., exact=True)) with the portable attention reference
and with the engine's own attention kernel (kernels="engine", where the profile's engine is importable:
run it with that engine's environment's python), measured side by side in one run.

    .venv/bin/python scripts/bench_exact.py [--profile NAME] [--tokens 256] [--repeats 3] [--layers 2]
        [--no-grad] [--modes unpatched,profile,exact,exact engine]
    .engines/vllm-0.32.0/bin/python scripts/bench_exact.py ...     # also exact mode with vLLM's kernel

Qwen2.5-0.5B's widths (hidden 896, MLP 4864, 14 heads, 2 KV heads, head_dim 64), a 256-token
vocabulary. Runs are interleaved (unpatched, profile, exact, unpatched, ...) after a warm-up, so a
change in machine load hits all three alike; ratios are of the medians. Exact mode's attention is
the bit-portable torch reference (one fused multiply-add per step of every dot product, emulated
in FP64 with a round-to-odd fix-up), which is what it costs here; absolute times hold for this
machine only.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from emulator import apply_profile
from emulator.errors import CapabilityMismatch, ExactModeUnavailable
from emulator.patching.apply import plan_patch
from engineprofiles.models import QWEN25_05B_WIDTHS, tiny_inputs, tiny_model
from engineprofiles.store import get_profile


def step(model, ids, grad: bool = True) -> tuple[float, float]:
    if not grad:
        t0 = time.perf_counter()
        with torch.no_grad():
            model(ids)
        return time.perf_counter() - t0, 0.0
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
    ap.add_argument("--profile", default="vllm-0.32.0-cpu-inductor-bfloat16-insitu")
    ap.add_argument("--family", default="qwen2", choices=["qwen2", "qwen3", "llama"])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-grad", action="store_true", help="a no-grad forward in eval mode (scoring), not forward + backward")
    ap.add_argument("--modes", default="unpatched,profile,exact,exact engine",
                    help="comma-separated: which trainers to time (unpatched always)")
    args = ap.parse_args()
    if min(args.tokens, args.layers, args.repeats) < 1:
        ap.error("--tokens, --layers and --repeats must be positive")
    prof = get_profile(args.profile)
    model = tiny_model(args.family, num_hidden_layers=args.layers, **QWEN25_05B_WIDTHS)
    model.train(not args.no_grad)
    ids = tiny_inputs(model, args.tokens)
    known = {"unpatched": None, "profile": (False, "auto"), "exact": (True, "portable"), "exact engine": (True, "engine")}
    wanted = {"unpatched", *(m.strip() for m in args.modes.split(","))}
    if wanted - set(known):
        ap.error(f"--modes: unknown {', '.join(sorted(wanted - set(known)))}; known: {', '.join(known)}")
    modes = {m: v for m, v in known.items() if m in wanted}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan_patch(model, prof, exact=True, kernels="engine")
    except ExactModeUnavailable as e:
        if "exact engine" in modes:
            print(f"exact engine: not measured here ({e})", flush=True)
            del modes["exact engine"]
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    said: set[str] = set()

    def run(mode: str) -> tuple[float, float]:
        ex = modes[mode]
        if ex is None:
            return step(model, ids, not args.no_grad)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("ignore", CapabilityMismatch)
            with apply_profile(model, prof, exact=ex[0], kernels=ex[1]):
                took = step(model, ids, not args.no_grad)
        for w in caught:  # each warning once (exact mode's note on this machine's GEMMs comes with every apply)
            if str(w.message) not in said:
                said.add(str(w.message))
                print(f"{w.category.__name__}: {w.message}", flush=True)
        return took

    print(f"{args.family}, Qwen2.5-0.5B widths, {args.layers} layers, {args.tokens} tokens, bf16, CPU "
          f"({torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, torch {torch.__version__}); "
          f"profile {prof.canonical_name}; {'no-grad forward (eval)' if args.no_grad else 'forward + backward'}, "
          f"median of {args.repeats}, interleaved; 'first': the first call (compiles)", flush=True)
    first = {m: sum(run(m)) for m in modes}  # warm-up: the first call compiles (exact mode's stack graph)
    for _ in range(args.repeats):
        for m in modes:
            times[m].append(run(m))
    base = times["unpatched"]
    if args.no_grad:
        print(f"{'trainer':<12} {'forward':>9} {'ratio':>7} {'first':>9}")
        for m, t in times.items():
            print(f"{m:<12} {med(t, 0):>8.2f}s {med(t, 0) / med(base, 0):>7.2f} {first[m]:>8.1f}s", flush=True)
        return 0
    print(f"{'trainer':<12} {'fwd+bwd':>9} {'forward':>9} {'backward':>9} {'ratio':>7} {'fwd ratio':>10} {'bwd ratio':>10} "
          f"{'first':>9}")
    for m, t in times.items():
        print(f"{m:<12} {med(t):>8.2f}s {med(t, 0):>8.2f}s {med(t, 1):>8.2f}s {med(t) / med(base):>7.2f} "
              f"{med(t, 0) / med(base, 0):>10.2f} {med(t, 1) / med(base, 1):>10.2f} {first[m]:>8.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
