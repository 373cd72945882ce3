"""Exploration demo: build vLLM's RMSNorm, SiluAndMul and rotary embedding outside the
engine (CPU, bf16), run every code path vLLM has for them, and report whether the paths
agree bitwise.

Run with an engine venv's python (see scripts/engine_env.sh), from any directory:

    .engines/vllm-0.32.0/bin/python scripts/_explore_vllm_layers.py [--no-compile] [--emulate-casts]

Paths per region (names used in the output):
  default        layer(...) as dispatched under the engine's default CPU config
                 (VllmConfig(): custom ops off -> forward_native; SiluAndMul's
                 forward_native is additionally wrapped in torch.compile by CustomOp)
  native         layer.forward_native(...) in eager mode (the PyTorch reference code)
  forward_cpu    layer.forward_cpu(...): what runs when the custom op is *enabled*
                 (custom_ops=['all'], e.g. enforce_eager / compilation mode NONE)
  ir_native      vllm.ir native implementation called directly (RMSNorm only)
  C_kernel       torch.ops._C.<op> CPU kernel called directly (out/in-place API)
  inductor       torch.compile(forward_native, fullgraph=True, dynamic=False,
                 backend=cc.backend, options=cc.inductor_compile_config) with dim 0
                 marked dynamic: a reproduction of how the engine compiles the model
  vllm_wrapper   the same region wrapped in vLLM's own @support_torch_compile
                 (TorchCompileWithNoGuardsWrapper, DYNAMO_TRACE_ONCE): the exact
                 mechanism the CPU engine applies to the whole model
  inductor_emul  'inductor' plus emulate_precision_casts=True (only with --emulate-casts)

Bitwise agreement is reported against 'native' (eager forward_native).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

# The compile cache of vLLM's AOT wrapper lives under ~/.cache/vllm; a probe should not
# load stale artifacts from there.  (Inductor's own FX-graph cache stays on: it only
# speeds up reruns.)
os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")

T_START = time.time()

import torch  # noqa: E402

BF16 = torch.bfloat16


def log(msg: str = "") -> None:
    print(msg, flush=True)


def tensors_of(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in out if isinstance(t, torch.Tensor)]


def bitwise_equal(a, b) -> bool:
    ta, tb = tensors_of(a), tensors_of(b)
    return len(ta) == len(tb) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        for x, y in zip(ta, tb)
    )


def mismatch(a, b) -> str:
    parts = []
    for x, y in zip(tensors_of(a), tensors_of(b)):
        if x.shape != y.shape or x.dtype != y.dtype:
            parts.append(f"{tuple(x.shape)}/{x.dtype} vs {tuple(y.shape)}/{y.dtype}")
            continue
        ne = (x != y).float().mean().item()
        md = (x.float() - y.float()).abs().max().item()
        parts.append(f"{ne:.1%} differ, max|d|={md:.3g}")
    return "; ".join(parts)


def describe(out) -> str:
    return ", ".join(f"{t.dtype}{list(t.shape)}" for t in tensors_of(out))


def run_paths(title: str, paths: dict[str, Callable[[], object]]) -> None:
    """Run each path (each gets fresh clones of the inputs), compare to 'native'."""
    log(f"\n== {title}")
    results: dict[str, object] = {}
    for name, fn in paths.items():
        t = time.time()
        try:
            results[name] = fn()
            dt = time.time() - t
            log(f"  {name:<14} {describe(results[name]):<44} {dt:7.2f}s")
        except Exception as e:  # noqa: BLE001 - exploration: report and go on
            log(f"  {name:<14} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
    ref = results.get("native")
    if ref is None:
        return
    for name, out in results.items():
        if name == "native":
            continue
        eq = bitwise_equal(out, ref)
        log(f"    {name:<14} vs native: {'BITWISE EQUAL' if eq else 'differ (' + mismatch(out, ref) + ')'}")
    # Groups of paths that agree with each other.
    groups: list[list[str]] = []
    for name, out in results.items():
        for g in groups:
            if bitwise_equal(out, results[g[0]]):
                g.append(name)
                break
        else:
            groups.append([name])
    log("    bitwise-equal groups: " + " | ".join("{" + ", ".join(g) + "}" for g in groups))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-compile", action="store_true", help="skip the Inductor paths")
    ap.add_argument(
        "--emulate-casts",
        action="store_true",
        help="also run Inductor with emulate_precision_casts=True",
    )
    ap.add_argument(
        "--all-rope",
        action="store_true",
        help="compile all four RoPE configs (default: only hd128/neox and hd64/gptj, "
        "to stay under ~2 min with a cold Inductor cache)",
    )
    ap.add_argument("--tokens", type=int, default=7)
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()

    import vllm
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.config.compilation import CompilationMode
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.platforms import current_platform

    try:
        import vllm.ir as vllm_ir
    except ImportError:  # older vLLM without the IR op layer
        vllm_ir = None

    log(f"vllm {vllm.__version__}, torch {torch.__version__}, "
        f"platform {type(current_platform).__name__}, "
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}, "
        f"avx512_bf16={torch.cpu._is_avx512_bf16_supported()}; "
        f"imports took {time.time() - T_START:.1f}s")

    # --- the engine's default configuration on this platform -----------------------
    vc = VllmConfig()
    cc = vc.compilation_config
    log("\n== default VllmConfig() on this platform (after CpuPlatform.check_and_update_config)")
    log(f"  mode={cc.mode!r} backend={cc.backend!r} custom_ops={cc.custom_ops}")
    log(f"  inductor_compile_config={cc.inductor_compile_config}")
    log(f"  ir_enable_torch_wrap={getattr(cc, 'ir_enable_torch_wrap', 'n/a')}")
    kc = getattr(vc, "kernel_config", None)
    if kc is not None and hasattr(kc, "ir_op_priority"):
        log(f"  kernel_config.ir_op_priority={kc.ir_op_priority}")
    log(f"  env set by the platform hook: TORCHINDUCTOR_CPP_DYNAMIC_THREADS="
        f"{os.environ.get('TORCHINDUCTOR_CPP_DYNAMIC_THREADS')}, "
        f"TORCHINDUCTOR_COMPILE_THREADS={os.environ.get('TORCHINDUCTOR_COMPILE_THREADS')}")

    def activate_worker_state(cfg: VllmConfig) -> None:
        # What the worker does at start-up (vllm/v1/worker/worker_base.py).
        k = getattr(cfg, "kernel_config", None)
        if k is not None and hasattr(k, "ir_op_priority"):
            k.ir_op_priority.set_default()
        if vllm_ir is not None and hasattr(vllm_ir, "set_default_torch_wrap"):
            vllm_ir.set_default_torch_wrap(cfg.compilation_config.ir_enable_torch_wrap)

    def method_name(m) -> str:
        fm = m._forward_method
        inner = getattr(fm, "_torchdynamo_orig_callable", None) or getattr(fm, "__wrapped__", None)
        if inner is not None:
            return f"torch.compile({getattr(inner, '__qualname__', inner)})"
        return getattr(fm, "__qualname__", repr(fm))

    # Dispatch under the "eager" configuration (enforce_eager => compilation mode NONE).
    eager_vc = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.NONE))
    with set_current_vllm_config(eager_vc):
        layers = [RMSNorm(64, dtype=BF16), SiluAndMul(),
                  get_rope(64, 256, True, {"rope_theta": 1e4}, BF16)]
        log(f"\n== dispatch with compilation mode NONE (enforce_eager): "
            f"custom_ops={eager_vc.compilation_config.custom_ops}")
        for m in layers:
            log(f"  {type(m).__name__:<16} enabled={m.enabled()}  forward -> {method_name(m)}")
    # get_rope() caches instances by its arguments, dispatch included: start afresh.
    import vllm.model_executor.layers.rotary_embedding as rope_mod
    rope_mod._ROPE_DICT.clear()

    opts = dict(cc.inductor_compile_config)

    def inductor(fn: Callable, emulate: bool = False) -> Callable:
        """The engine's whole-model compile, applied to one region."""
        o = dict(opts)
        if emulate:
            o["emulate_precision_casts"] = True
        compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend=cc.backend, options=o)
        patches = {}
        if hasattr(torch._inductor.config, "assume_32bit_indexing"):
            # set by vLLM's decorators.py around the first compile
            patches["assume_32bit_indexing"] = (
                cc.dynamic_shapes_config.assume_32_bit_indexing
                if hasattr(cc, "dynamic_shapes_config") else False)

        def call(*a):
            for t in a:
                if isinstance(t, torch.Tensor):
                    torch._dynamo.mark_dynamic(t, 0)
            with torch._inductor.config.patch(**patches):
                return compiled(*a)
        return call

    from vllm.compilation.decorators import support_torch_compile

    def vllm_wrapper(layer: torch.nn.Module, kind: str) -> Callable:
        """Wrap one layer the way vLLM wraps a model (exact engine compile mechanism).
        One instance per input shape family: DYNAMO_TRACE_ONCE drops all guards."""
        if kind == "rope":
            @support_torch_compile(dynamic_arg_dims={"positions": 0, "query": 0, "key": 0})
            class RopeRegion(torch.nn.Module):
                def __init__(self, *, vllm_config, prefix: str = ""):
                    super().__init__()
                    self.layer = layer

                def forward(self, positions: torch.Tensor, query: torch.Tensor,
                            key: torch.Tensor):
                    return self.layer(positions, query, key)
            return RopeRegion(vllm_config=vc)
        if kind == "norm_res":
            @support_torch_compile(dynamic_arg_dims={"x": 0, "residual": 0})
            class NormResRegion(torch.nn.Module):
                def __init__(self, *, vllm_config, prefix: str = ""):
                    super().__init__()
                    self.layer = layer

                def forward(self, x: torch.Tensor, residual: torch.Tensor):
                    return self.layer(x, residual)
            return NormResRegion(vllm_config=vc)

        @support_torch_compile(dynamic_arg_dims={"x": 0})
        class Region(torch.nn.Module):
            def __init__(self, *, vllm_config, prefix: str = ""):
                super().__init__()
                self.layer = layer

            def forward(self, x: torch.Tensor):
                return self.layer(x)
        return Region(vllm_config=vc)

    compile_on = not args.no_compile
    torch.manual_seed(0)
    T, H = args.tokens, args.hidden

    with set_current_vllm_config(vc):
        activate_worker_state(vc)

        # ---------------------------------------------------------------- RMSNorm
        norm = RMSNorm(H, eps=1e-6, dtype=BF16)  # dtype= sets the weight dtype (engine: model dtype)
        with torch.no_grad():
            norm.weight.normal_(1.0, 0.1)
        w, eps = norm.weight.data, norm.variance_epsilon
        log(f"\n== RMSNorm: weight {w.dtype}, default forward -> {method_name(norm)}")
        x = torch.randn(T, H, dtype=BF16) * 2
        res = torch.randn(T, H, dtype=BF16)

        def c_rms():
            out = torch.empty_like(x)
            torch.ops._C.rms_norm(out, x.clone(), w, eps)
            return out

        paths = {
            "default": lambda: norm(x.clone()),
            "native": lambda: norm.forward_native(x.clone()),
            "forward_cpu": lambda: norm.forward_cpu(x.clone()),
        }
        if vllm_ir is not None and hasattr(vllm_ir.ops, "rms_norm"):
            paths["ir_native"] = lambda: vllm_ir.ops.rms_norm.impls["native"].impl_fn(
                x.clone(), w, eps, None)
        paths["C_kernel"] = c_rms
        if compile_on:
            f = inductor(norm.forward_native)
            paths["inductor"] = lambda: f(x.clone())
            wr = vllm_wrapper(norm, "norm")
            paths["vllm_wrapper"] = lambda: wr(x.clone())
            if args.emulate_casts:
                fe = inductor(norm.forward_native, emulate=True)
                paths["inductor_emul"] = lambda: fe(x.clone())
        run_paths(f"RMSNorm(x) x={describe(x)}", paths)

        # ------------------------------------------------ RMSNorm with residual
        def c_fused():
            xx, rr = x.clone(), res.clone()
            torch.ops._C.fused_add_rms_norm(xx, rr, w, eps)  # in place: xx=out, rr=x+res
            return xx, rr

        paths = {
            "default": lambda: norm(x.clone(), res.clone()),
            "native": lambda: norm.forward_native(x.clone(), res.clone()),
            "forward_cpu": lambda: norm.forward_cpu(x.clone(), res.clone()),
        }
        if vllm_ir is not None and hasattr(vllm_ir.ops, "fused_add_rms_norm"):
            paths["ir_native"] = lambda: vllm_ir.ops.fused_add_rms_norm.impls[
                "native"].impl_fn(x.clone(), res.clone(), w, eps, None)
        paths["C_kernel"] = c_fused
        if compile_on:
            f2 = inductor(lambda a, b: norm.forward_native(a, b))
            paths["inductor"] = lambda: f2(x.clone(), res.clone())
            wr2 = vllm_wrapper(norm, "norm_res")
            paths["vllm_wrapper"] = lambda: wr2(x.clone(), res.clone())
            if args.emulate_casts:
                fe2 = inductor(lambda a, b: norm.forward_native(a, b), emulate=True)
                paths["inductor_emul"] = lambda: fe2(x.clone(), res.clone())
        run_paths(f"RMSNorm(x, residual) -> (out, residual) x={describe(x)}", paths)

        # ------------------------------------------------------------- SiluAndMul
        act = SiluAndMul()
        act_eager = SiluAndMul(compile_native=False) if "compile_native" in \
            SiluAndMul.__init__.__code__.co_varnames else None
        log(f"\n== SiluAndMul: default forward -> {method_name(act)}")
        xs = torch.randn(T, 2 * H, dtype=BF16) * 2

        def c_silu():
            out = torch.empty(T, H, dtype=BF16)
            torch.ops._C.silu_and_mul(out, xs.clone())
            return out

        paths = {
            "default": lambda: act(xs.clone()),
            "native": lambda: SiluAndMul.forward_native(xs.clone()),
            "forward_cpu": lambda: act.forward_cpu(xs.clone()),
        }
        if act_eager is not None:
            paths["compile_native=False"] = lambda: act_eager(xs.clone())
        paths["C_kernel"] = c_silu
        if compile_on:
            f3 = inductor(SiluAndMul.forward_native)
            paths["inductor"] = lambda: f3(xs.clone())
            wr3 = vllm_wrapper(act_eager if act_eager is not None else act, "act")
            paths["vllm_wrapper"] = lambda: wr3(xs.clone())
            if args.emulate_casts:
                fe3 = inductor(SiluAndMul.forward_native, emulate=True)
                paths["inductor_emul"] = lambda: fe3(xs.clone())
        run_paths(f"SiluAndMul x={describe(xs)}", paths)

        # ------------------------------------------------------------------ RoPE
        n_q, n_kv, max_pos = 8, 2, 4096  # GQA: 8 query heads, 2 kv heads
        for head, neox in [(128, True), (128, False), (64, True), (64, False)]:
            rope = get_rope(head, max_pos, neox, {"rope_theta": 10000.0}, BF16)
            log(f"\n== RoPE head_dim={head} neox={neox}: {type(rope).__name__}, "
                f"cos_sin_cache {rope.cos_sin_cache.dtype}{list(rope.cos_sin_cache.shape)}, "
                f"default forward -> {method_name(rope)}")
            pos = torch.randint(0, max_pos, (T,))
            q = torch.randn(T, n_q * head, dtype=BF16)
            k = torch.randn(T, n_kv * head, dtype=BF16)

            def c_rope(rope=rope, pos=pos, q=q, k=k):
                qq, kk = q.clone(), k.clone()  # in place
                torch.ops._C.rotary_embedding(pos, qq, kk, rope.head_size,
                                              rope.cos_sin_cache, rope.is_neox_style)
                return qq, kk

            paths = {
                "default": lambda rope=rope, pos=pos, q=q, k=k: rope(pos, q.clone(), k.clone()),
                "native": lambda rope=rope, pos=pos, q=q, k=k: rope.forward_native(
                    pos, q.clone(), k.clone()),
                "forward_cpu": lambda rope=rope, pos=pos, q=q, k=k: rope.forward_cpu(
                    pos, q.clone(), k.clone()),
                "C_kernel": c_rope,
            }
            if compile_on and (args.all_rope or (head, neox) in [(128, True), (64, False)]):
                f4 = inductor(rope.forward_native)
                paths["inductor"] = lambda f4=f4, pos=pos, q=q, k=k: f4(
                    pos.clone(), q.clone(), k.clone())
                wr4 = vllm_wrapper(rope, "rope")
                paths["vllm_wrapper"] = lambda wr4=wr4, pos=pos, q=q, k=k: wr4(
                    pos.clone(), q.clone(), k.clone())
                if args.emulate_casts:
                    fe4 = inductor(rope.forward_native, emulate=True)
                    paths["inductor_emul"] = lambda fe4=fe4, pos=pos, q=q, k=k: fe4(
                        pos.clone(), q.clone(), k.clone())
            run_paths(f"RoPE forward(positions, q, k) q={describe(q)} k={describe(k)}", paths)

    log(f"\ntotal {time.time() - T_START:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
