#!/usr/bin/env python
"""Which point of the attention lattice is vLLM's AVX2 CPU attention kernel? The kernel op itself, called
outside the engine (VllmAdapter.attention: the backend's own cache layout, scheduler and ISA choice).

Run with the engine environment's python, emulated on an AVX-512 host (or natively on an AVX2 one):

    scripts/emulate_cpu.sh avx2 .engines/vllm-0.32.0/bin/python scripts/check_avx2_attention.py [--json out.json]

1. The probe's attention inputs (two seeds): the match rate of the AVX2 kernel's point, the AVX512
   kernel's point, and the AVX2 point with the exp correctly rounded.
2. glibc's expf is not always correctly rounded, but a 1-ulp difference in one softmax numerator
   rarely reaches a BF16 output, so on the inputs of 1 the AVX2 point and the same point with
   ``exp=correctly_rounded`` tie. Here: decode rows over two keys whose logits are 0 and x = a*b exactly
   (BF16 a, b; head dim 128, 64 heads), with x drawn where glibc's expf and the correctly rounded exp
   differ; the calls on which the two points give different outputs go through the kernel, and the
   elements where the points differ are counted by the point the kernel matched.

Prints JSON; exit 0 when the kernel is the AVX2 point everywhere (and 2 told the exps apart), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--draws", type=int, default=12, help="blocks of 2M (a, b) draws searched for x in part 2")
    args = ap.parse_args()

    from engineloop.capture import emulate_cpu, kernel_libraries

    emulated = emulate_cpu()  # before vLLM is imported
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    from engineprofiles.probe.adapters.vllm import VllmAdapter
    from engineprofiles.probe.attention import KERNEL_STARTS, AttentionSample, attention_inputs, score
    from engineprofiles.regions import attention_ref
    from engineprofiles.regions.attention import exp_glibc_expf

    impl = VllmAdapter().attention()
    fn = impl.fn
    points = {name: p for name, p in KERNEL_STARTS}
    avx2 = points["vLLM's CPU attention kernel, AVX2 build"]
    avx512 = points["vLLM's CPU attention kernel"]
    cr = avx2.replace(exp="correctly_rounded")
    res: dict = dict(kernel=impl.path, emulated=emulated, kernel_libraries=kernel_libraries(),
                     cpu_capability=torch.backends.cpu.get_cpu_capability())

    samples = []
    for seed in (0, 1):
        for path, q, k, v, scale in attention_inputs(torch.bfloat16, seed):
            samples.append(AttentionSample(q, k, v, fn(q, k, v, scale=scale).reshape(q.shape), scale, path))
    res["probe_inputs"] = {label: {"matched": s.matched, "total": s.total, "max_ulp": s.max_ulp}
                           for label, s in (("avx2_point", score(avx2, samples)), ("avx512_point", score(avx512, samples)),
                                            ("avx2_point_exp_correctly_rounded", score(cr, samples)))}

    g = torch.Generator().manual_seed(5)
    A, B = [], []
    for _ in range(args.draws):
        a = -(torch.rand(2_000_000, generator=g) * 12 + 0.01).bfloat16().float()
        b = (torch.rand(2_000_000, generator=g) + 1).bfloat16().float()
        x = a * b  # exact: two BF16 significands
        d = exp_glibc_expf(x) != torch.exp(x.double()).float()
        A.append(a[d])
        B.append(b[d])
    a, b = torch.cat(A), torch.cat(B)
    heads, dim = 64, 128
    t = dict(x_values=len(a), calls=0, elements_differing=0, kernel_equals_glibc=0, kernel_equals_correctly_rounded=0,
             kernel_equals_neither=0, calls_equal_to_avx2_point_everywhere=0)
    for c in range(len(a) // heads):
        q, k = torch.zeros(1, heads, dim), torch.zeros(2, heads, dim)
        q[0, :, 0], k[1, :, 0] = a[c * heads:(c + 1) * heads], b[c * heads:(c + 1) * heads]
        v = torch.randn(2, heads, dim, generator=g)
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
        r1, r2 = attention_ref(q, k, v, avx2, scale=1.0), attention_ref(q, k, v, cr, scale=1.0)
        m = r1 != r2
        if not bool(m.any()):
            continue
        out = fn(q, k, v, scale=1.0).reshape(r1.shape)
        t["calls"] += 1
        t["elements_differing"] += int(m.sum())
        t["kernel_equals_glibc"] += int((out[m] == r1[m]).sum())
        t["kernel_equals_correctly_rounded"] += int((out[m] == r2[m]).sum())
        t["kernel_equals_neither"] += int(((out[m] != r1[m]) & (out[m] != r2[m])).sum())
        t["calls_equal_to_avx2_point_everywhere"] += int(torch.equal(out, r1))
    res["exp_discriminating"] = t
    p = res["probe_inputs"]["avx2_point"]
    res["ok"] = bool(p["matched"] == p["total"] and t["elements_differing"] > 0
                     and t["kernel_equals_glibc"] == t["elements_differing"]
                     and t["calls_equal_to_avx2_point_everywhere"] == t["calls"])
    text = json.dumps(res, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
