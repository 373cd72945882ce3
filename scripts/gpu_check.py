#!/usr/bin/env python
"""GPU check of the emulator's Triton kernels: bit-exactness on CUDA, then speed and memory.

Run from the repository root on a machine with one NVIDIA GPU (torch, triton, transformers
installed; pydantic is not needed; Liger-Kernel is optional):

    PYTHONUNBUFFERED=1 python scripts/gpu_check.py --out gpu_check.json

Part 1, correctness on the device. For every canonical lattice point of every region, in BF16 and
FP16, on odd shapes (hidden 151, 896, 16384, zero tokens, GQA heads, positions beyond 32k, both
RoPE styles, strided inputs): the kernels' forward on CUDA equals the reference with
``math="portable"`` computed on the CPU, bit for bit (NaN in the same places); their backward on
CUDA equals the portable torch backward on the CPU bit for bit (that backward is proven within
FP32 error bounds of FP64 autograd by tests/emulator, in the Triton interpreter). Every lattice
point and shape is its own GPU binary; compiling ~450 of them is most of this part's time, so it
runs in --workers processes (default: up to 12).

Part 2, speed, at Qwen2.5-7B shapes (hidden 3584, intermediate 18944, 28 query heads and 4 KV
heads of dim 128; --tokens tokens, BF16): forward, backward and both, as median milliseconds over
--reps runs (CUDA events), peak extra memory, and achieved bandwidth (the bytes the op must move
at least, over its time), for the emulator at HF transformers' own rounding point, against HF's
eager code for the same region, and against Liger-Kernel where it is installed (its lattice
point is measured first; the ratio is reported with how well its rounding matches).

``--smoke`` runs both parts on the CPU through the Triton interpreter with tiny shapes and one
repetition: it checks this script, not the GPU (tests/emulator runs it so).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

if "--smoke" in sys.argv:  # the kernels must be defined in interpreter mode: before any import of them
    os.environ["TRITON_INTERPRET"] = "1"
    import numpy as np

    np.seterr(all="ignore")  # the interpreter runs on numpy, which warns on the NaN/Inf inputs

import torch  # noqa: E402

from emulator.ops.rmsnorm import AddRMSNormFunction, RMSNormFunction, rmsnorm_bwd, rmsnorm_bwd_torch  # noqa: E402
from emulator.ops.rope import RoPEFunction, rope_bwd, rope_bwd_torch  # noqa: E402
from emulator.ops.swiglu import SwiGLUFunction, swiglu_bwd, swiglu_bwd_torch  # noqa: E402
from engineprofiles.regions import (  # noqa: E402
    ADD_SPEC, PLAIN_SPEC, ROPE_SPEC, SWIGLU_SPEC, add_rmsnorm_ref, rmsnorm_ref, rope_cos_sin, rope_ref, swiglu_ref,
)

DTYPES = (torch.bfloat16, torch.float16)
EPS = 1e-6
# HF transformers' eager modules (every op on activation-dtype tensors rounds its result).
HF_POINTS = {
    "rope": ROPE_SPEC.point(cos_sin="rounded", products="rounded"),
    "swiglu": SWIGLU_SPEC.point(silu="rounded", silu_formula="fused"),
    "rmsnorm": PLAIN_SPEC.point(normalized="rounded", output="rounded", rstd="rsqrt"),
    "add_rmsnorm": ADD_SPEC.point(
        variance_input="rounded", normalize_input="rounded", normalized="rounded", residual_out="rounded", rstd="rsqrt"
    ),
}


# -- part 1: bit-exactness ---------------------------------------------------------------------------

_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    gn, wn = torch.isnan(got), torch.isnan(want)
    if not torch.equal(gn, wn):
        return False
    return torch.equal(got.contiguous().view(_INT[got.dtype])[~gn], want.contiguous().view(_INT[want.dtype])[~wn])


def _acts(shape, dtype, gen, scale=3.0, specials=True):
    x = torch.randn(shape, generator=gen) * scale
    flat = x.view(-1)
    if specials and flat.numel() >= 8:
        big = 6.0e4 if dtype == torch.float16 else 3.0e38
        idx = torch.randperm(flat.numel(), generator=gen)[:8]
        flat[idx] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, big, -big, 1.0 + 2**-8])
    return x.to(dtype)


def bitexact_checks(device: torch.device, smoke: bool) -> list[tuple[str, object]]:
    """Every check of part 1 as (name, thunk returning True when bit-exact). Inputs are made from
    a per-check seed, so any subset of the list (a worker's shard) builds the same tensors."""
    checks: list[tuple[str, object]] = []

    def add(name, fn):
        checks.append((name, fn))

    def gen(name):
        return torch.Generator().manual_seed(zlib.crc32(name.encode()))

    def pts(points, full: bool, keep: int = 2):
        """The whole lattice on one shape per region; its ends and middle on the others (each point
        is its own GPU binary, and the interpreter tests already cover every point on every shape)."""
        if smoke:
            return points[:keep] + points[-1:]
        return points if full else [points[0], points[len(points) // 2], points[-1]]

    # RoPE: (tokens, heads, head_dim, rotary dim); GQA heads, partial rotary, zero tokens, long positions.
    rope_shapes = [(2, 14, 64, 64), (3, 2, 128, 96)] if smoke else [
        (5, 14, 64, 64), (3, 2, 128, 96), (0, 2, 64, 64), (257, 28, 128, 128), (257, 4, 128, 128)]
    for dtype in DTYPES:
        for style in ("neox", "interleaved"):
            for i, (t, h, d, rot) in enumerate(rope_shapes):
                for p in pts(ROPE_SPEC.all_points(), full=i in (0, 1)):
                    name = f"rope fwd {dtype} {style} {(t, h, d, rot)} {p.label()}"

                    def fwd(name=name, t=t, h=h, d=d, rot=rot, p=p, dtype=dtype, style=style):
                        g = gen(name)
                        x = _acts((t, h, d), dtype, g)
                        cos, sin = rope_cos_sin(torch.randint(0, 140_000, (t,), generator=g), rot)
                        y = RoPEFunction.apply(x.to(device), cos[:, None].to(device), sin[:, None].to(device), p, style, dtype, "triton")
                        return same_bits(y, rope_ref(x, cos, sin, p, style=style))

                    add(name, fwd)
                name = f"rope bwd {dtype} {style} {(t, h, d, rot)}"

                def bwd(name=name, t=t, h=h, d=d, rot=rot, dtype=dtype, style=style):
                    g = gen(name)
                    dy = _acts((t, h, d), dtype, g)
                    cos, sin = rope_cos_sin(torch.randint(0, 140_000, (t,), generator=g), rot)
                    got = rope_bwd(dy.to(device), cos[:, None].to(device), sin[:, None].to(device), style, dtype)
                    return same_bits(got, rope_bwd_torch(dy, cos[:, None], sin[:, None], style, dtype))

                add(name, bwd)
    # SwiGLU: (rows, intermediate), gate and up the two halves of a fused gate_up output (strided).
    sw_shapes = [(3, 151)] if smoke else [(5, 151), (3, 896), (1, 16384), (0, 64), (129, 18944)]
    for dtype in DTYPES:
        for i, (m, n) in enumerate(sw_shapes):
            def inputs(name, m=m, n=n, dtype=dtype):
                gu = _acts((m, 2 * n), dtype, gen(name))
                return gu[:, :n], gu[:, n:]

            for p in pts(SWIGLU_SPEC.all_points(), full=True):
                name = f"swiglu fwd {dtype} {(m, n)} {p.label()}"

                def fwd(name=name, p=p, dtype=dtype, inputs=inputs):
                    gate, up = inputs(name)
                    y = SwiGLUFunction.apply(gate.to(device), up.to(device), p, dtype, "triton")
                    return same_bits(y, swiglu_ref(gate, up, p, math="portable"))

                add(name, fwd)
            name = f"swiglu bwd {dtype} {(m, n)}"

            def bwd(name=name, m=m, n=n, dtype=dtype, inputs=inputs):
                gate, up = inputs(name)
                dy = _acts((m, n), dtype, gen(name + "dy"))
                got = swiglu_bwd(gate.to(device), up.to(device), dy.to(device))
                want = swiglu_bwd_torch(gate, up, dy, "portable")
                return same_bits(got[0], want[0]) and same_bits(got[1], want[1])

            add(name, bwd)
    # RMSNorm, plain and with the residual add (activation-dtype and FP32 residual stream).
    rms_shapes = [(3, 151)] if smoke else [(5, 151), (3, 896), (1, 16384), (0, 896), (300, 3584), (257, 5120)]
    for dtype in DTYPES:
        for i, (m, n) in enumerate(rms_shapes):
            def inputs(name, m=m, n=n, dtype=dtype, specials=True):
                g = gen(name)
                x = _acts((m, n), dtype, g, specials=specials)
                r = _acts((m, n), dtype, g, scale=10.0, specials=specials)
                w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
                return x, r, w

            for p in pts(PLAIN_SPEC.all_points(), full=i == 1):
                name = f"rmsnorm fwd {dtype} {(m, n)} {p.label()}"

                def fwd(name=name, p=p, dtype=dtype, inputs=inputs):
                    x, _, w = inputs(name)
                    y = RMSNormFunction.apply(x.to(device), w.to(device), EPS, p, dtype, "triton")
                    return same_bits(y, rmsnorm_ref(x, w, EPS, p, math="portable"))

                add(name, fwd)
            for p in pts(ADD_SPEC.all_points(), full=i == 1, keep=4):
                for res_dtype in (dtype, torch.float32):
                    name = f"add_rmsnorm fwd {dtype} {(m, n)} residual {res_dtype} {p.label()}"

                    def fwd_add(name=name, p=p, dtype=dtype, res_dtype=res_dtype, inputs=inputs):
                        x, r, w = inputs(name)
                        r = r.to(res_dtype)
                        out, ro = AddRMSNormFunction.apply(x.to(device), r.to(device), w.to(device), EPS, p, dtype, "triton")
                        want = add_rmsnorm_ref(x, r, w, EPS, p, math="portable")
                        return same_bits(out, want[0]) and same_bits(ro, want[1])

                    add(name, fwd_add)
            for res_dtype in (None, dtype, torch.float32):
                name = f"rmsnorm bwd {dtype} {(m, n)} residual {res_dtype}"

                def bwd(name=name, m=m, n=n, dtype=dtype, res_dtype=res_dtype, inputs=inputs):
                    x, r, w = inputs(name, specials=False)
                    g = gen(name + "grads")
                    dy = _acts((m, n), dtype, g, specials=False)
                    res = None if res_dtype is None else r.to(res_dtype)
                    dres = None if res_dtype is None else _acts((m, n), dtype, g, specials=False).to(res_dtype)
                    on = lambda t: None if t is None else t.to(device)  # noqa: E731
                    got = rmsnorm_bwd(x.to(device), on(res), w.to(device), EPS, dy.to(device), on(dres))
                    want = rmsnorm_bwd_torch(x, res, w, EPS, dy, dres, "portable")
                    return all((a is None and b is None) or same_bits(a, b) for a, b in zip(got, want))

                add(name, bwd)
    if device.type == "cuda":
        def dispatch():
            try:
                from emulator import functional as F
            except ImportError as e:  # pragma: no cover - depends on the machine (pydantic)
                print(f"  FAIL: the functional API cannot be imported, so its dispatch is not checked: {e}")
                return False
            x = _acts((2, 3, 896), torch.bfloat16, gen("dispatch"))
            w = torch.ones(896, dtype=torch.bfloat16)
            p = PLAIN_SPEC.all_points()[-1]
            return same_bits(F.rmsnorm(x.to(device), w.to(device), EPS, p), rmsnorm_ref(x, w, EPS, p, math="portable"))

        add("functional.rmsnorm on CUDA dispatches to the kernels", dispatch)
    return checks


def run_checks(device: torch.device, smoke: bool, shard: int = 0, shards: int = 1) -> tuple[int, list[str]]:
    passed, failed = 0, []
    for i, (name, fn) in enumerate(bitexact_checks(device, smoke)):
        if i % shards != shard:
            continue
        try:
            ok = fn()
        except Exception as e:  # noqa: BLE001 - a crash is a failed check, reported with its reason
            ok, name = False, f"{name} ({type(e).__name__}: {str(e)[:300]})"
        if ok:
            passed += 1
        else:
            failed.append(name)
            print(f"  MISMATCH: {name}", flush=True)
    return passed, failed


def run_checks_in_workers(workers: int) -> tuple[int, list[str]]:
    """Part 1 on CUDA in parallel processes: each lattice point and shape is its own kernel
    binary, and compiling them is what takes the time (CPU-bound, one core each)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i in range(workers):
            out = Path(tmp) / f"shard{i}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--shard", f"{i}/{workers}", "--shard-out", str(out)]
            procs.append((subprocess.Popen(cmd), out))
        passed, failed = 0, []
        for proc, out in procs:
            proc.wait()
            if proc.returncode != 0 or not out.exists():
                failed.append(f"worker {out.stem} exited with {proc.returncode}")
                continue
            data = json.loads(out.read_text())
            passed += data["passed"]
            failed += data["failed"]
    return passed, failed


# -- part 2: speed and memory ------------------------------------------------------------------------


def _timer(device: torch.device, reps: int):
    def run(fn) -> float:
        for _ in range(2 if reps > 1 else 0):
            fn()
        times = []
        for _ in range(reps):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return run


def _peak_mib(device: torch.device, fn) -> float:
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _measure(device, reps, forward, inputs, bytes_fwd, bytes_bwd):
    """Median times of forward, backward and both; peak extra memory of both; bandwidth (the
    bytes the op must move at least, over its time) of forward and backward."""
    run = _timer(device, reps)
    leaves = [t.detach().clone().requires_grad_() for t in inputs]

    def as_tuple(o):
        return o if isinstance(o, tuple) else (o,)

    def fwd():
        with torch.no_grad():
            forward(*leaves)

    outs = as_tuple(forward(*leaves))
    cots = [torch.randn_like(o) for o in outs]

    def bwd():
        torch.autograd.grad(outs, leaves, cots, retain_graph=True)

    def both():
        torch.autograd.grad(as_tuple(forward(*leaves)), leaves, cots)

    t_f, t_b, t_fb = run(fwd), run(bwd), run(both)
    gbps = lambda nbytes, ms: nbytes / (ms * 1e-3) / 1e9 if ms > 0 else float("nan")  # noqa: E731
    return {
        "fwd_ms": t_f, "bwd_ms": t_b, "fwd_bwd_ms": t_fb, "peak_mib": _peak_mib(device, both),
        "fwd_GBps": gbps(bytes_fwd, t_f), "bwd_GBps": gbps(bytes_bwd, t_b),
    }


def _liger():
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError:
        return None
    return {"rmsnorm": LigerRMSNormFunction, "rope": LigerRopeFunction, "swiglu": LigerSiLUMulFunction}


def _best_point(spec, got, reference) -> tuple[str, float]:
    """The lattice point (and math mode) whose reference output an implementation's output
    matches best, and the fraction of elements it matches bit for bit."""
    best = ("", -1.0)
    for p in spec.all_points():
        for math_mode in ("torch", "portable"):
            want = reference(p, math_mode)
            rate = float((got.float() == want.float()).float().mean())
            if rate > best[1]:
                best = (f"{p.label()} (math={math_mode})", rate)
    return best


def benchmark(device: torch.device, tokens: int, reps: int, smoke: bool) -> list[dict]:
    from torch.func import functional_call
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, apply_rotary_pos_emb

    hidden, inter, qh, kvh, hd = (256, 512, 14, 2, 64) if smoke else (3584, 18944, 28, 4, 128)
    bf = torch.bfloat16
    gen = torch.Generator().manual_seed(1)
    rows: list[dict] = []
    liger = _liger()
    if liger is None:
        print("  (Liger-Kernel is not installed: its rows are skipped; pip install liger-kernel to add them)")

    def dev(t):
        return t.to(device)

    def add_row(region, impl, point, res, match=None):
        row = {"region": region, "impl": impl, "point": point, **res}
        if match is not None:
            row["liger_matches_point_rate"] = match
        rows.append(row)
        print(f"  {region:11s} {impl:8s} fwd {res['fwd_ms']:8.3f} ms  bwd {res['bwd_ms']:8.3f} ms  both "
              f"{res['fwd_bwd_ms']:8.3f} ms  peak {res['peak_mib']:8.1f} MiB  fwd {res['fwd_GBps']:7.1f} GB/s  "
              f"bwd {res['bwd_GBps']:7.1f} GB/s  [{point}{'' if match is None else f', matches {match:.2%}'}]", flush=True)

    # -- RMSNorm (no add) and residual add + RMSNorm, hidden 3584 --
    x = dev(torch.randn(tokens, hidden, generator=gen).to(bf))
    r = dev(torch.randn(tokens, hidden, generator=gen).to(bf) * 10)
    w = dev((1 + 0.1 * torch.randn(hidden, generator=gen)).to(bf))
    a = tokens * hidden * 2  # bytes of one activation tensor
    hf_norm = Qwen2RMSNorm(hidden, eps=EPS).to(device=device, dtype=bf)

    def hf_rms(x, w):
        return functional_call(hf_norm, {"weight": w}, (x,))

    def hf_add_rms(x, r, w):  # the decoder layer's residual add, then its norm module
        s = x + r
        return functional_call(hf_norm, {"weight": w}, (s,)), s

    p = HF_POINTS["rmsnorm"]
    emu = lambda x, w: RMSNormFunction.apply(x, w, EPS, p, bf, "triton")  # noqa: E731
    add_row("rmsnorm", "emulator", p.label(), _measure(device, reps, emu, [x, w], 2 * a, 3 * a))
    add_row("rmsnorm", "hf", "HF eager", _measure(device, reps, hf_rms, [x, w], 2 * a, 3 * a))
    if liger is not None:
        def liger_rms():
            lig = lambda x, w: liger["rmsnorm"].apply(x, w, EPS)  # noqa: E731
            match = _best_point(PLAIN_SPEC, lig(x, w).detach(), lambda q, m: rmsnorm_ref(x, w, EPS, q, math=m))
            add_row("rmsnorm", "liger", match[0], _measure(device, reps, lig, [x, w], 2 * a, 3 * a), match[1])

        _guarded("rmsnorm", liger_rms)
    p_add = HF_POINTS["add_rmsnorm"]
    emu = lambda x, r, w: AddRMSNormFunction.apply(x, r, w, EPS, p_add, bf, "triton")  # noqa: E731
    add_row("add_rmsnorm", "emulator", p_add.label(), _measure(device, reps, emu, [x, r, w], 4 * a, 6 * a))
    add_row("add_rmsnorm", "hf", "HF eager", _measure(device, reps, hf_add_rms, [x, r, w], 4 * a, 6 * a))

    # -- SwiGLU, intermediate 18944 --
    gate = dev(torch.randn(tokens, inter, generator=gen).to(bf) * 3)
    up = dev(torch.randn(tokens, inter, generator=gen).to(bf))
    a = tokens * inter * 2
    p = HF_POINTS["swiglu"]
    emu = lambda g, u: SwiGLUFunction.apply(g, u, p, bf, "triton")  # noqa: E731
    add_row("swiglu", "emulator", p.label(), _measure(device, reps, emu, [gate, up], 3 * a, 5 * a))
    add_row("swiglu", "hf", "HF eager", _measure(device, reps, lambda g, u: torch.nn.functional.silu(g) * u, [gate, up], 3 * a, 5 * a))
    if liger is not None:
        def liger_swiglu():
            lig = lambda g, u: liger["swiglu"].apply(g, u)  # noqa: E731
            match = _best_point(SWIGLU_SPEC, lig(gate, up).detach(), lambda q, m: swiglu_ref(gate, up, q, math=m))
            add_row("swiglu", "liger", match[0], _measure(device, reps, lig, [gate, up], 3 * a, 5 * a), match[1])

        _guarded("swiglu", liger_swiglu)

    # -- RoPE of a layer's q (28 heads) and k (4 heads), head_dim 128, positions from 30000 --
    batch = 4 if tokens % 4 == 0 else 1
    seq = tokens // batch
    q = dev(torch.randn(batch, seq, qh, hd, generator=gen).to(bf))
    k = dev(torch.randn(batch, seq, kvh, hd, generator=gen).to(bf))
    cos, sin = (dev(t) for t in rope_cos_sin(torch.arange(seq) + 30_000, hd))
    cs3 = cos[None].expand(batch, seq, hd // 2).reshape(tokens, 1, hd // 2)
    sn3 = sin[None].expand(batch, seq, hd // 2).reshape(tokens, 1, hd // 2)
    a = (qh + kvh) * tokens * hd * 2
    p = HF_POINTS["rope"]

    def emu_rope(q, k):
        yq = RoPEFunction.apply(q.reshape(tokens, qh, hd), cs3, sn3, p, "neox", bf, "triton")
        yk = RoPEFunction.apply(k.reshape(tokens, kvh, hd), cs3, sn3, p, "neox", bf, "triton")
        return yq, yk

    cos_hf = torch.cat((cos, cos), -1).to(bf)[None].expand(batch, -1, -1)
    sin_hf = torch.cat((sin, sin), -1).to(bf)[None].expand(batch, -1, -1)

    def hf_rope(q, k):  # HF's layout: [batch, heads, seq, head_dim] views of the projections
        return apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos_hf, sin_hf)

    cs_bytes = 2 * tokens * (hd // 2) * 4
    add_row("rope", "emulator", p.label(), _measure(device, reps, emu_rope, [q, k], 2 * a + cs_bytes, 2 * a + cs_bytes))
    add_row("rope", "hf", "HF eager", _measure(device, reps, hf_rope, [q, k], 2 * a, 2 * a))
    if liger is not None:
        def liger_rope():
            def lig_rope(q, k):
                return liger["rope"].apply(q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), cos_hf, sin_hf)

            yq = lig_rope(q, k)[0].transpose(1, 2).detach()
            cb, sb = cos[None].expand(batch, -1, -1), sin[None].expand(batch, -1, -1)
            match = _best_point(ROPE_SPEC, yq, lambda pt, m: rope_ref(q, cb, sb, pt))
            add_row("rope", "liger", match[0], _measure(device, reps, lig_rope, [q, k], 2 * a, 2 * a), match[1])

        _guarded("rope", liger_rope)
    return rows


def _guarded(region: str, fn) -> None:
    """Run one Liger-Kernel benchmark; its API moves between versions, so a failure is reported
    and the rest goes on."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        print(f"  {region:11s} liger    failed: {type(e).__name__}: {str(e)[:200]}", flush=True)


def _ratios(rows: list[dict]) -> list[str]:
    out = []
    by = {(r["region"], r["impl"]): r for r in rows}
    for region in ("rmsnorm", "add_rmsnorm", "swiglu", "rope"):
        emu = by.get((region, "emulator"))
        for other in ("hf", "liger"):
            o = by.get((region, other))
            if emu and o:
                ratio = " ".join(f"{k.split('_ms')[0]} {emu[k] / o[k]:.2f}x" for k in ("fwd_ms", "bwd_ms", "fwd_bwd_ms") if o[k] > 0)
                out.append(f"  {region:12s} emulator / {other}: {ratio}  (time; < 1 is faster)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per step in the benchmarks (default 4 x 4096)")
    ap.add_argument("--reps", type=int, default=50, help="timed repetitions (median reported)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--skip-bench", action="store_true", help="only the bit-exactness checks")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes: checks this script")
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1),
                    help="processes for part 1 (kernel compilation is the slow part); 1: in this process")
    ap.add_argument("--shard", help=argparse.SUPPRESS)
    ap.add_argument("--shard-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.shard:  # a worker of run_checks_in_workers
        i, n = (int(v) for v in args.shard.split("/"))
        passed, failed = run_checks(torch.device("cuda"), False, i, n)
        args.shard_out.write_text(json.dumps({"passed": passed, "failed": failed}))
        return 0

    if args.smoke:
        device, tokens, reps = torch.device("cpu"), 8, 1
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run this on a GPU machine (or --smoke to check the script on CPU)")
            return 2
        device, tokens, reps = torch.device("cuda"), args.tokens, args.reps
    import triton

    info = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__, "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "tokens": tokens, "reps": reps,
    }
    print(json.dumps(info), flush=True)
    print("part 1: bit-exactness of every kernel against the portable reference", flush=True)
    t0 = time.time()
    if args.smoke or args.workers <= 1:
        passed, failed = run_checks(device, args.smoke)
    else:
        passed, failed = run_checks_in_workers(args.workers)
    print(f"  {passed} checks bit-exact, {len(failed)} mismatched or failed ({time.time() - t0:.0f} s)", flush=True)
    rows: list[dict] = []
    if not args.skip_bench:
        print(f"part 2: speed and memory, {tokens} tokens, Qwen2.5-7B shapes, median of {reps}", flush=True)
        rows = benchmark(device, tokens, reps, args.smoke)
        for line in _ratios(rows):
            print(line)
    if args.out:
        clean = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()} for row in rows]
        result = {"info": info, "bitexact_passed": passed, "bitexact_failed": failed, "bench": clean}
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
