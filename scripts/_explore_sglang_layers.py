#!/usr/bin/env python
"""Exploration demo: build SGLang's RMSNorm, SiluAndMul and RoPE outside the engine
on CPU in bf16 and run every code path that is available on this host.

Run with the SGLang venv's python (see scripts/_sglang_env.sh), e.g.

    .engines/sglang-0.5.23/bin/python scripts/_explore_sglang_layers.py [--no-compile]

It prints, for each layer and each path, dtypes/shapes and whether the paths agree
bitwise with the path SGLang's CPU engine picks by default, plus a few hand-written
references that make the BF16 rounding points visible.  On 2 cores: about 1.5 min with a
warm Inductor cache, about 2.3 min on the very first run (Inductor's cold start),
about 30 s with --no-compile.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Must be set before sglang is imported: sglang.srt.utils.is_cpu() reads it once
# (lru_cache) and module-level `_is_cpu` flags are computed at import time.
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

import warnings  # noqa: E402

warnings.filterwarnings("ignore", message="Only CUDA")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

T0 = time.time()
import sglang  # noqa: E402
from sglang.kernels.fused_op import _platform_key, get_fused_op_backend  # noqa: E402
from sglang.kernels.spec import KernelBackend  # noqa: E402
from sglang.srt.layers.activation import SiluAndMul  # noqa: E402
from sglang.srt.layers.layernorm import RMSNorm  # noqa: E402
from sglang.srt.layers.rotary_embedding import get_rope  # noqa: E402
from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding  # noqa: E402
from sglang.srt.utils import cpu_has_amx_support, is_cpu  # noqa: E402

IMPORT_S = time.time() - T0
BF16 = torch.bfloat16


def sgl_kernel_status() -> str:
    try:
        import sgl_kernel  # noqa: F401
    except Exception as e:  # ImportError, or OSError from a CUDA-only build
        return f"not importable ({type(e).__name__}: {str(e).splitlines()[0][:100]})"
    has_cpu_ops = hasattr(torch.ops.sgl_kernel, "convert_weight_packed")
    return f"importable, CPU ops registered: {has_cpu_ops}"


def same(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"MISMATCH shape/dtype {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}"
    if torch.equal(a, b):
        return "bitwise equal"
    diff = a.float() != b.float()
    maxabs = (a.float() - b.float()).abs().max().item()
    return f"DIFFER in {int(diff.sum())}/{a.numel()} elems (max abs {maxabs:.3g})"


def paths_for(op, use_compile: bool):
    """Callables for every path of a BaseFusedOp that can run here."""
    paths = {
        "default (engine dispatch)": lambda *a: op(*a),
        "forward_native": lambda *a: op.forward_native(*a),
        "forward_cpu": lambda *a: op.forward_cpu(*a),
    }
    if use_compile:
        paths["torch_compile(forward_native)"] = lambda *a: op(
            *a, backend=KernelBackend.TORCH_COMPILE
        )
    return paths


def header(title: str) -> None:
    print(f"\n=== {title} ===")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile path")
    args = ap.parse_args()
    use_compile = not args.no_compile
    torch.manual_seed(0)

    header("environment")
    print(f"python {sys.version.split()[0]}  torch {torch.__version__}  sglang {sglang.__version__}")
    print(f"import time of the three layer modules: {IMPORT_S:.1f}s")
    print(f"SGLANG_USE_CPU_ENGINE={os.environ.get('SGLANG_USE_CPU_ENGINE')}  is_cpu()={is_cpu()}")
    print(f"torch.cpu._is_amx_tile_supported()={torch.cpu._is_amx_tile_supported()}  "
          f"cpu capability={torch.backends.cpu.get_cpu_capability()}")
    print(f"cpu_has_amx_support()={cpu_has_amx_support()}  (AMX tiles AND sgl_kernel CPU ops)")
    print(f"sgl_kernel: {sgl_kernel_status()}")
    print(f"BaseFusedOp platform key={_platform_key()!r} ('' -> forward_native; 'cpu' only with AMX)")
    print(f"SGLANG_FORCE_FUSED_OP_BACKEND -> {get_fused_op_backend()}")

    # ---------------------------------------------------------------- RMSNorm
    header("RMSNorm (hidden 1024, eps 1e-6, bf16 weight ~ 1)")
    H = 1024
    # The engine builds layers with torch's default dtype set to the model dtype,
    # so the weight is bf16 there; do the same here.
    torch.set_default_dtype(BF16)
    norm = RMSNorm(H, eps=1e-6)
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.1 * torch.randn(H))
    x = torch.randn(7, H, dtype=BF16) * 3
    res = torch.randn(7, H, dtype=BF16) * 3
    print(f"weight {norm.weight.dtype}{tuple(norm.weight.shape)}; x {x.dtype}{tuple(x.shape)}")

    outs, outs_r = {}, {}
    with torch.no_grad():
        for name, fn in paths_for(norm, use_compile).items():
            t = time.time()
            outs[name] = fn(x.clone())
            o, r = fn(x.clone(), res.clone())
            outs_r[name] = (o, r)
            print(f"  {name:32s} out {outs[name].dtype}{tuple(outs[name].shape)}; "
                  f"with residual -> (out {o.dtype}, residual {r.dtype})  [{time.time() - t:.1f}s]")
        base = outs["default (engine dispatch)"]
        base_o, base_r = outs_r["default (engine dispatch)"]
        for name in outs:
            if name.startswith("default"):
                continue
            print(f"  {name:32s} vs default: no-res {same(outs[name], base)}; "
                  f"res out {same(outs_r[name][0], base_o)}; res residual {same(outs_r[name][1], base_r)}")
        # References that expose the rounding points.
        w = norm.weight.float()
        xf = x.float()
        ref = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w).to(BF16)
        print(f"  ref fp32 all-through, one rounding at end     vs default: {same(ref, base)}")
        s32 = xf + res.float()
        ref_r_fp32sum = (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + 1e-6) * w).to(BF16)
        s16 = s32.to(BF16).float()
        ref_r_bf16sum = (s16 * torch.rsqrt(s16.pow(2).mean(-1, keepdim=True) + 1e-6) * w).to(BF16)
        print(f"  residual out == bf16(x+res)                   : {same(s32.to(BF16), base_r)}")
        print(f"  res-norm from fp32 sum (unrounded)  vs default: {same(ref_r_fp32sum, base_o)}")
        print(f"  res-norm from bf16-rounded sum      vs default: {same(ref_r_bf16sum, base_o)}")
        norm_cx = RMSNorm(H, eps=1e-6, cast_x_before_out_mul=True).to(BF16)
        norm_cx.weight.data.copy_(norm.weight.data)
        print(f"  cast_x_before_out_mul=True (HF style)   vs default: {same(norm_cx(x.clone()), base)}")

    # ------------------------------------------------------------- SiluAndMul
    header("SiluAndMul (input [tokens, 2*d] = [9, 2*688])")
    act = SiluAndMul()
    d = 688
    xa = torch.randn(9, 2 * d, dtype=BF16) * 2
    outs = {}
    with torch.no_grad():
        for name, fn in paths_for(act, use_compile).items():
            t = time.time()
            outs[name] = fn(xa)
            print(f"  {name:32s} in {xa.dtype}{tuple(xa.shape)} -> out {outs[name].dtype}"
                  f"{tuple(outs[name].shape)}  [{time.time() - t:.1f}s]")
        base = outs["default (engine dispatch)"]
        for name in outs:
            if not name.startswith("default"):
                print(f"  {name:32s} vs default: {same(outs[name], base)}")
        g, u = xa[:, :d].float(), xa[:, d:].float()
        one = (F.silu(g) * u).to(BF16)
        two = (F.silu(g).to(BF16).float() * u).to(BF16)
        print(f"  ref one rounding  bf16(silu(g)*u)          vs default: {same(one, base)}")
        print(f"  ref two roundings bf16(bf16(silu(g))*u)    vs default: {same(two, base)}")
        if use_compile:
            print(f"  ref one rounding vs torch_compile path: {same(one, outs['torch_compile(forward_native)'])}")

    # ------------------------------------------------------------------- RoPE
    header("RoPE via get_rope (max_pos 4096, base 10000, GQA 8 q heads / 2 kv heads)")
    ntok = 6
    positions = torch.randint(0, 4096, (ntok,))
    for head_dim in (64, 128):
        for neox in (True, False):
            # In the engine get_rope(dtype=None) takes torch's default dtype = model dtype.
            rope = get_rope(head_dim, head_dim, 4096, 10000, is_neox_style=neox, dtype=BF16)
            q = torch.randn(ntok, 8 * head_dim, dtype=BF16)
            k = torch.randn(ntok, 2 * head_dim, dtype=BF16)
            tag = f"head_dim={head_dim} {'neox' if neox else 'gptj'}"
            outs = {}
            with torch.no_grad():
                for name, fn in paths_for(rope, use_compile).items():
                    t = time.time()
                    qo, ko = fn(positions, q.clone(), k.clone())
                    outs[name] = (qo, ko)
                    if head_dim == 64 and neox:
                        print(f"  [{tag}] {name:30s} q {qo.dtype}{tuple(qo.shape)} "
                              f"k {ko.dtype}{tuple(ko.shape)}  [{time.time() - t:.1f}s]")
                bq, bk = outs["default (engine dispatch)"]
                for name in outs:
                    if not name.startswith("default"):
                        print(f"  [{tag}] {name:30s} vs default: q {same(outs[name][0], bq)}; "
                              f"k {same(outs[name][1], bk)}")
                # fp32 cos/sin cache (SGLANG_ROPE_CACHE_FP32=1) -- read at construction,
                # and get_rope caches instances by key, so build one directly.
                os.environ["SGLANG_ROPE_CACHE_FP32"] = "1"
                rope32 = RotaryEmbedding(head_dim, head_dim, 4096, 10000, neox, BF16)
                del os.environ["SGLANG_ROPE_CACHE_FP32"]
                q32, k32 = rope32(positions, q.clone(), k.clone())
                print(f"  [{tag}] SGLANG_ROPE_CACHE_FP32=1 ({rope32.cos_sin_cache.dtype} cache) vs default: "
                      f"q {same(q32, bq)}; k {same(k32, bk)}")
                # References: cos/sin rounded to bf16 (default CPU cache dtype), then
                # (a) one rounding of the whole rotation, (b) per-op bf16 rounding.
                cs = rope.cos_sin_cache.index_select(0, positions).float()
                cos, sin = cs.chunk(2, dim=-1)
                cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
                qv = q.view(ntok, -1, head_dim).float()
                if neox:
                    x1, x2 = qv.chunk(2, dim=-1)
                else:
                    x1, x2 = qv[..., ::2], qv[..., 1::2]

                def pack(o1, o2):
                    o = torch.cat((o1, o2), -1) if neox else torch.stack((o1, o2), -1).flatten(-2)
                    return o.reshape(ntok, -1)

                one = pack((x1 * cos - x2 * sin).to(BF16), (x2 * cos + x1 * sin).to(BF16))

                def r(t):
                    return t.to(BF16).float()

                perop = pack((r(r(x1 * cos) - r(x2 * sin))).to(BF16),
                             (r(r(x2 * cos) + r(x1 * sin))).to(BF16))
                print(f"  [{tag}] ref one rounding (bf16 cos/sin)           vs default q: {same(one, bq)}")
                print(f"  [{tag}] ref per-op bf16 rounding (bf16 cos/sin)   vs default q: {same(perop, bq)}")
                if use_compile:
                    cq = outs["torch_compile(forward_native)"][0]
                    print(f"  [{tag}] ref one rounding vs torch_compile path q: {same(one, cq)}")

    print(f"\ntotal {time.time() - T0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
