#!/usr/bin/env python
"""Does ``KVSplit`` (engineprofiles.regions.attention) split and merge as vLLM's CPU attention does with
``VLLM_CPU_ATTN_SPLIT_KV=1``? The kernel op itself, called outside the engine the way its backend calls it
(the backend's paged cache, its scheduler op ``cpu_attn_get_scheduler_metadata`` with ``enable_kv_split``).

Run with the engine environment's python (on an AVX-512 host; ``scripts/emulate_cpu.sh avx2`` in front for
the AVX2 build):

    .engines/vllm-0.32.0/bin/python scripts/check_split_kv_attention.py [--json out.json] [--quick]

1. Plans: the chunks the scheduler gives each split query row (read from the metadata tensor it returns:
   its work items, each a (query start, query count, first key, end key, split id) of one request) against
   ``KVSplit.plan``, over thread counts 1-4, head layouts (GQA groups that fit the kernel's 8 query heads
   per iteration and ones that do not), decode steps and prefills whose last query tile has one token.
2. Outputs: the kernel's BF16 output against ``attention_ref`` at the build's point with the plan, for both
   merge variants and without the split (the rows the plan splits, head dims 64 and 128).
3. Batches: calls over several requests at once (decode steps of requests decoded together, with and
   without prefills beside them): the scheduler's split rows against ``KVSplit.plan_batch``, and the
   kernel's output of every split row against ``attention_ref`` with that row's chunks.

Prints JSON; exit 0 when every plan is the scheduler's and the build's merge matches every element of
every split row, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

# AttentionMetadata (csrc/cpu/cpu_attn_impl.hpp, vLLM 0.32.0): int32 fields from byte 64 (after an atomic
# counter and its padding): isa, workitem_group_num, reduction_item_num, ...; the work items (40 bytes each:
# five int32, padding, an int64, two int32) and reduction items (20 bytes) end the tensor.
_WORKITEM_BYTES, _REDUCTION_BYTES = 40, 20


def work_items(meta: torch.Tensor, with_request: bool = False) -> list[tuple[int, int, int, int, int]]:
    """(query start, query count, first key, end key, split id) of every work item in the metadata;
    ``with_request``: (request, query start, first key, end key, split id)."""
    w = meta.view(torch.int32)
    n_work, n_red = int(w[17]), int(w[18])
    header = meta.numel() - n_work * _WORKITEM_BYTES - n_red * _REDUCTION_BYTES
    if header <= 0 or header % 4:
        raise SystemExit(f"the scheduler metadata ({meta.numel()} bytes, {n_work} work items) is not the layout this "
                         "script reads (vLLM 0.32.0's AttentionMetadata); update work_items()")
    rows = w[header // 4: header // 4 + n_work * 10].view(n_work, 10)
    if with_request:
        return [(int(r[0]), int(r[1]), int(r[3]), int(r[4]), int(r[8])) for r in rows]
    return [(int(r[1]), int(r[2]), int(r[3]), int(r[4]), int(r[8])) for r in rows]


class _Fixed:
    """A KVSplit whose plan for a one-query call is the given chunks (a row of a batch, checked alone)."""

    def __init__(self, split, ranges):
        self.merge, self._ranges = split.merge, list(ranges)

    def plan(self, tq, tk, hq, hk):
        return [(0, self._ranges)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (the test suite's run)")
    args = ap.parse_args()

    from engineloop.capture import emulate_cpu, kernel_libraries

    emulated = emulate_cpu()  # before vLLM is imported
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from engineprofiles.probe.attention import KERNEL_STARTS
    from engineprofiles.regions import attention_ref
    from engineprofiles.regions.attention import KVSplit

    avx2 = not (torch.backends.cpu.get_cpu_capability().startswith("AVX512")) or bool(emulated)
    name = "vLLM's CPU attention kernel, AVX2 build" if avx2 else "vLLM's CPU attention kernel"
    point = dict(KERNEL_STARTS)[name]
    build_merge = "mul_add" if avx2 else "fma"
    dtype, block_size = torch.bfloat16, 128

    def kernel_batch(reqs, threads):
        """One kernel call over the requests [(q, k, v)] (each [T, H, D]) in order: their outputs and the
        scheduler's work items (request, query start, first key, end key, split id)."""
        torch.set_num_threads(threads)
        _, hq, d = reqs[0][0].shape
        hk = reqs[0][1].shape[1]
        isa = _get_attn_isa(dtype, block_size, d)
        nblocks = [(k.shape[0] + block_size - 1) // block_size for _, k, _ in reqs]
        cache = torch.zeros(sum(nblocks), hk, block_size, 2 * d, dtype=dtype)
        kc, vc = cache.view(sum(nblocks), hk, 2 * block_size, d).chunk(2, dim=2)
        table = torch.zeros(len(reqs), max(nblocks), dtype=torch.int32)
        first = 0
        for r, ((_, k, v), nb) in enumerate(zip(reqs, nblocks)):
            table[r, :nb] = torch.arange(first, first + nb, dtype=torch.int32)
            slots = first * block_size + torch.arange(k.shape[0], dtype=torch.int64)
            ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
            first += nb
        qlens = [q.shape[0] for q, _, _ in reqs]
        qsl = torch.tensor([sum(qlens[:r]) for r in range(len(reqs) + 1)], dtype=torch.int32)
        sl = torch.tensor([k.shape[0] for _, k, _ in reqs], dtype=torch.int32)
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(reqs), num_heads=hq, num_kv_heads=hk, head_dim=d, seq_lens=sl, dtype=dtype,
            query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=True)
        q_all = torch.cat([q for q, _, _ in reqs])
        out = torch.empty_like(q_all)
        ops.cpu_attention_with_kv_cache(
            query=q_all, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl, seq_lens=sl, scale=d ** -0.5,
            causal=True, alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
            scheduler_metadata=meta, s_aux=None)
        return list(out.split(qlens)), work_items(meta, with_request=True)

    def kernel(q, k, v, threads):
        outs, items = kernel_batch([(q, k, v)], threads)
        return outs[0], [(qs, None, a, b, sid) for _, qs, a, b, sid in items]

    heads = ((8, 1), (8, 2), (16, 2), (4, 4), (14, 2), (12, 2), (32, 8)) if not args.quick else ((4, 2), (14, 2))
    decode = (17, 100, 200, 300, 700, 1500) if not args.quick else (100, 200, 700)
    prefill = (1, 3, 9, 17, 33, 65, 129, 257) if not args.quick else (9, 65)
    shapes = [(1, n) for n in decode] + [(n, n) for n in prefill] + [(n, n + 50) for n in (3, 17, 33)]
    threads_all = (1, 2, 3, 4) if not args.quick else (2, 4)
    res = dict(point=name, build_merge=build_merge, emulated=emulated, kernel_libraries=kernel_libraries(),
               cpu_capability=torch.backends.cpu.get_cpu_capability(), plans=0, plans_equal=0, split_plans=0,
               plan_differences=[], outputs={})
    counts = {m: [0, 0] for m in ("fma", "mul_add", "unsplit")}
    g = torch.Generator().manual_seed(0)
    for d in (64, 128):
        for hq, hk in heads:
            for threads in threads_all:
                for tq, tk in shapes:
                    q = torch.randn(tq, hq, d, generator=g).to(dtype)
                    k = torch.randn(tk, hk, d, generator=g).to(dtype)
                    v = torch.randn(tk, hk, d, generator=g).to(dtype)
                    out, items = kernel(q, k, v, threads)
                    got = [(qs, a, b) for qs, _, a, b, sid in items if sid != -1]
                    plan = KVSplit(threads=threads).plan(tq, tk, hq, hk)
                    want = [(row, a, b) for row, ranges in plan for a, b in ranges]
                    res["plans"] += 1
                    res["plans_equal"] += got == want
                    res["split_plans"] += bool(want)
                    if got != want and len(res["plan_differences"]) < 10:
                        res["plan_differences"].append(dict(threads=threads, heads=[hq, hk], tq=tq, tk=tk,
                                                            scheduler=got, plan=want))
                    if not plan:
                        continue
                    rows = [row for row, _ in plan]
                    for m in counts:
                        split = None if m == "unsplit" else KVSplit(threads=threads, merge=m)
                        ref = attention_ref(q, k, v, point, scale=d ** -0.5, kv_split=split)
                        same = ref[rows].view(torch.int16) == out[rows].view(torch.int16)
                        counts[m][0] += int(same.sum())
                        counts[m][1] += same.numel()
    res["outputs"] = {f"merge_{m}" if m != "unsplit" else "not_split": dict(matched=a, total=n)
                      for m, (a, n) in counts.items()}

    # 3. batches: several requests in one call, the plan of the whole call
    batch = dict(calls=0, plans_equal=0, split_rows=0, rows_not_their_own_plan=0, plan_differences=[],
                 elements_matched=0, elements=0)
    rng = torch.Generator().manual_seed(1)
    n_calls = 240 if not args.quick else 24
    layouts = [(hq, hk, d) for d in (64, 128) for hq, hk in heads]
    for c in range(n_calls):
        hq, hk, d = layouts[c % len(layouts)]
        threads = threads_all[(c // len(layouts)) % len(threads_all)]
        n_req = int(torch.randint(2, 7, (1,), generator=rng))
        shapes_b = []
        for _ in range(n_req):
            tk = int(torch.randint(17, 700 if not args.quick else 400, (1,), generator=rng))
            kind = int(torch.randint(0, 4, (1,), generator=rng))  # mostly decode steps, some prefills
            tq = 1 if kind else int(torch.randint(2, min(tk, 130) + 1, (1,), generator=rng))
            shapes_b.append((tq, tk))
        reqs = [(torch.randn(tq, hq, d, generator=g).to(dtype), torch.randn(tk, hk, d, generator=g).to(dtype),
                 torch.randn(tk, hk, d, generator=g).to(dtype)) for tq, tk in shapes_b]
        outs, items = kernel_batch(reqs, threads)
        got = [(r, qs, a, b) for r, qs, a, b, sid in items if sid != -1]
        split = KVSplit(threads=threads, merge=build_merge)
        plan = split.plan_batch(shapes_b, hq, hk)
        want = [(r, row, a, b) for r, row, ranges in plan for a, b in ranges]
        batch["calls"] += 1
        batch["plans_equal"] += got == want
        batch["split_rows"] += len(plan)
        alone = {(r, row, tuple(rg)) for r, (tq, tk) in enumerate(shapes_b)
                 for row, rg in split.plan(tq, tk, hq, hk)}
        batch["rows_not_their_own_plan"] += len({(r, row, tuple(rg)) for r, row, rg in plan} ^ alone)
        if got != want and len(batch["plan_differences"]) < 10:
            batch["plan_differences"].append(dict(threads=threads, heads=[hq, hk], requests=shapes_b,
                                                  scheduler=got, plan=want))
        for r, row, ranges in plan:
            q, k, v = reqs[r]
            tq, tk = shapes_b[r]
            # the row alone, with exactly the batch's chunks for it
            ref = attention_ref(q[row:row + 1], k[: tk - tq + row + 1], v[: tk - tq + row + 1], point,
                                scale=d ** -0.5, kv_split=_Fixed(split, ranges))
            same = ref[0].view(torch.int16) == outs[r][row].view(torch.int16)
            batch["elements_matched"] += int(same.sum())
            batch["elements"] += same.numel()
    res["batches"] = batch
    ok = (res["plans_equal"] == res["plans"] and res["split_plans"] > 0
          and counts[build_merge][0] == counts[build_merge][1] > 0
          and batch["plans_equal"] == batch["calls"] and batch["elements_matched"] == batch["elements"] > 0)
    res["ok"] = ok
    text = json.dumps(res, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
