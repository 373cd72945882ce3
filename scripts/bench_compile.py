#!/usr/bin/env python
"""torch.compile of a patched model: compile time, and the step time compiled against eager.

    .venv/bin/python scripts/bench_compile.py [--family qwen2 ...] [--exact] [--tokens 64] [--repeats 5]
                                              [--widths tiny|qwen2.5-0.5b]

For each family: a tiny model (2 layers; ``--widths qwen2.5-0.5b`` for Qwen2.5-0.5B's widths) is
patched with the in-situ vLLM profile (every region emulated; ``--exact``: exact mode too), and a
training step (forward with labels, backward) is timed eagerly and through ``torch.compile``. The
first compiled step includes compiling (Dynamo, AOTAutograd, Inductor's C++ build; a warm Inductor
cache in /tmp makes it shorter); the later ones are interleaved with eager steps after a warm-up,
so a change in machine load hits both alike. Each compiled step is checked to be bit-equal to the
eager one (logits, loss and every gradient), so the numbers are of the same computation.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from emulator import apply_profile
from engineprofiles.models import QWEN25_05B_WIDTHS, tiny_inputs, tiny_model

PROFILE = "vllm-0.32.0-cpu-inductor-bfloat16-insitu"


def step(run, model, ids):
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    out = run(ids, labels=ids)
    out.loss.backward()
    dt = time.perf_counter() - t0
    grads = [p.grad.clone() for p in model.parameters()]
    return dt, out.loss.detach(), out.logits.detach(), grads


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip((a[1], a[2], *a[3]), (b[1], b[2], *b[3])))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", action="append", help="qwen2, qwen3, llama (default: all three)")
    ap.add_argument("--exact", action="store_true", help="apply in exact mode")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--widths", choices=("tiny", "qwen2.5-0.5b"), default="tiny")
    args = ap.parse_args()
    widths = QWEN25_05B_WIDTHS if args.widths == "qwen2.5-0.5b" else {}
    print(f"{PROFILE}{' (exact)' if args.exact else ''}; {args.widths} widths, 2 layers, {args.batch} x {args.tokens} "
          f"tokens, bf16, CPU ({torch.get_num_threads()} threads, torch {torch.__version__}); a training step, "
          f"median of {args.repeats}")
    print(f"{'family':<8} {'first compiled step':>20} {'eager':>9} {'compiled':>9} {'ratio':>6}  bit-equal")
    ok = True
    for fam in args.family or ["qwen2", "qwen3", "llama"]:
        torch._dynamo.reset()
        model = tiny_model(fam, seed=1, **widths)
        model.train()
        ids = tiny_inputs(model, args.tokens, batch=args.batch)
        with apply_profile(model, PROFILE, exact=args.exact):
            compiled = torch.compile(model)
            first = step(compiled, model, ids)
            eager, comp, equal = [], [], same(first, step(model, model, ids))
            for _ in range(args.repeats):
                e, c = step(model, model, ids), step(compiled, model, ids)
                eager.append(e[0])
                comp.append(c[0])
                equal = equal and same(c, e)
        me, mc = statistics.median(eager), statistics.median(comp)
        ok = ok and equal
        print(f"{fam:<8} {first[0]:>19.1f}s {me:>8.3f}s {mc:>8.3f}s {mc / me:>6.2f}  {'yes' if equal else 'NO'}",
              flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
