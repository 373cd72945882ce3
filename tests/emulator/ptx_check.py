"""Compile the emulator's kernels for an NVIDIA GPU without one, and count telling PTX instructions.

Run as a script in a process without TRITON_INTERPRET (``python -m tests.emulator.ptx_check``):
the launchers are called with small CPU tensors while ``JITFunction.run`` is replaced by a
recorder, so each kernel is specialized exactly as the launchers specialize it; each recorded
launch is then compiled by Triton's real pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the
bundled ptxas) for sm_90 (H100/H200). Prints one JSON object: per compiled kernel, the counts of
instructions that would break bit-exactness:

- ``fma``: fused multiply-adds (contraction must be off: ``enable_fp_fusion=False``),
- ``approx``: approximate division, square root, reciprocal, exp2 (``div.full``, ``*.approx``),
- ``ftz``: flush-to-zero of subnormals, except in ``cvt.rmi`` (floor), whose arguments in
  portable.exp are never subnormal (see emulator/ops/tl_portable.py),

and, for information, the correctly rounded ``div.rn.f32`` and ``sqrt.rn.f32`` it uses.
"""

from __future__ import annotations

import json
import os
import re
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("ptx_check compiles for a GPU: run it without TRITON_INTERPRET=1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

_TYPES = {torch.float32: "fp32", torch.int16: "i16", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")
recorded: list[tuple[JITFunction, tuple, dict]] = []


def _record(self, *args, grid, warmup, **kwargs):
    recorded.append((self, args, kwargs))


def _signature(fn: JITFunction, args: tuple, kwargs: dict):
    names = fn.arg_names
    values = dict(zip(names, args))
    values.update({k: v for k, v in kwargs.items() if k not in _OPTIONS})
    sig, consts = {}, {}
    for i, name in enumerate(names):
        v = values[name]
        if name in kwargs and name not in _OPTIONS:
            sig[name] = "constexpr"
            consts[(i,)] = v
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + _TYPES[v.dtype]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i64" if abs(v) >= 2**31 else "i32"
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}.{name}: cannot type {v!r}")
    return sig, consts


def _launch_everything() -> None:
    from engineprofiles.regions import ADD_SPEC, PLAIN_SPEC, ROPE_SPEC, SWIGLU_SPEC, rope_cos_sin
    from emulator.ops import _utils, rmsnorm, rope, swiglu

    _utils.FORCE_GPU_TILES = True  # the tile sizes a GPU launch would use

    bf, hf = torch.bfloat16, torch.float16
    x = torch.zeros(3, 2, 64, dtype=bf)
    cos, sin = rope_cos_sin(torch.arange(3), 64)
    cs, sn = cos[:, None], sin[:, None]
    for p in ROPE_SPEC.all_points():
        rope.rope_fwd(x, cs, sn, p, "neox", bf)
    rope.rope_fwd(x.half(), cs, sn, ROPE_SPEC.all_points()[0], "interleaved", hf)
    rope.rope_bwd(x, cs, sn, "neox", bf)
    g = torch.zeros(3, 151, dtype=bf)
    for p in SWIGLU_SPEC.all_points()[3:]:  # silu rounded, each formula
        swiglu.swiglu_fwd(g, g, p, bf)
    swiglu.swiglu_fwd(g.half(), g.half(), SWIGLU_SPEC.all_points()[0], hf)
    swiglu.swiglu_bwd(g, g, g)
    g = torch.zeros(3, 600, dtype=bf)  # several chunks of 256 columns per iteration
    w = torch.ones(600, dtype=bf)
    rmsnorm.rmsnorm_fwd(g, w, 1e-6, PLAIN_SPEC.all_points()[-1], bf)  # every site rounded, x / sqrt
    rmsnorm.add_rmsnorm_fwd(g, g, w, 1e-6, ADD_SPEC.all_points()[-1], bf)
    rmsnorm.add_rmsnorm_fwd(g.half(), g.float(), w, 1e-6, ADD_SPEC.all_points()[0], hf)  # all FP32, rsqrt
    rmsnorm.rmsnorm_bwd(g, g.float(), w, 1e-6, g, g.float())


def main(arch: int = 90) -> dict:
    JITFunction.run = _record  # record launches instead of running them
    _launch_everything()
    target = GPUTarget("cuda", arch, 32)
    # A control: the first RoPE launch (FP32 products, no FMA variant) compiled with contraction
    # left on, to show that the counts below would see it.
    fn, args, kwargs = recorded[0]
    control = [(fn, args, {**kwargs, "enable_fp_fusion": True, "_control": True})]
    out = {}
    for fn, args, kwargs in recorded + control:
        control_run = kwargs.pop("_control", False)
        sig, consts = _signature(fn, args, kwargs)
        options = {k: kwargs[k] for k in _OPTIONS if k in kwargs}
        compiled = triton.compile(ASTSource(fn, sig, constexprs=consts), target=target, options=options)
        ptx = compiled.asm["ptx"]
        body = "\n".join(line for line in ptx.splitlines() if not line.lstrip().startswith("//"))
        key = f"{fn.__name__}[{','.join(f'{k}={v}' for k, v in kwargs.items() if k not in _OPTIONS and k.isupper())}]"
        key = "control: contraction on " + key if control_run else key
        out[key] = {
            "fma": len(re.findall(r"\bfma\.", body)),
            "approx": len(re.findall(r"\b(div\.full|div\.approx|sqrt\.approx|rsqrt\.approx|rcp\.approx|ex2\.approx)", body)),
            "ftz": len(re.findall(r"\.ftz\b", body)) - len(re.findall(r"\bcvt\.rmi\.ftz\.f32\.f32", body)),
            "div_rn": len(re.findall(r"\bdiv\.rn\.f32", body)),
            "sqrt_rn": len(re.findall(r"\bsqrt\.rn\.f32", body)),
            "cubin_bytes": len(compiled.asm.get("cubin", b"")),
        }
    return out


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)))
