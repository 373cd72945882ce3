"""SGLang: its own layer classes, run as its CPU engine runs them.

SGLang picks each layer's implementation at call time (``BaseFusedOp`` dispatch): on a CPU with
AMX tiles and the ``sgl_kernel`` CPU build it uses those kernels, otherwise ``forward_native``
(eager torch). The default mode calls the layer exactly as the engine does, so the probe measures
whichever path this host takes, and the evidence names it. ``mode="compiled"`` is the
torch.compile backend the engine uses with ``--enable-torch-compile``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ...engines import ENGINES
from ...names import check_mode_name
from ..base import Adapter, EngineInfo, EngineNotInstalled, RegionImpl, Unavailable

MODES = ENGINES["sglang"].modes
# Attention probe cases on top of the standard ones, where torch's CPU flash attention has choices the
# standard cases leave tied: long flat rows with head dims 128 and 96 (softmax scales that are not powers
# of two: where the scale multiplies) and many short rows of many heads (the row sum's order: rows of
# fewer than 16 keys are summed in order, longer ones lane-wise, which shows in an output bit rarely).
ATTENTION_CASES = (("decode", 1, 511, 8, 2, 128, 0.5), ("chunk", 3, 400, 8, 2, 128, 0.5),
                   ("chunk", 40, 480, 8, 2, 128, 0.5), ("decode", 1, 257, 8, 2, 96, 0.5),
                   ("prefill", 15, 15, 128, 8, 256, 0.3), ("prefill", 24, 24, 64, 8, 256, 1.0))
INSTALL_HINT = "scripts/engine_env.sh sglang 0.5.23"


def _import_sglang():
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # read once at import by sglang.srt.utils.is_cpu
    try:
        import sglang
        from sglang.srt.layers import activation, layernorm, rotary_embedding  # noqa: F401
    except ImportError as e:
        raise EngineNotInstalled(
            f"SGLang is not installed in this Python environment ({e}). Make its environment with "
            f"`{INSTALL_HINT}` and run the probe there (probe-engine finds .engines/sglang-* by itself)."
        ) from None
    return sglang


class SglangAdapter(Adapter):
    name = "sglang"
    modes = MODES

    def __init__(self, mode: str = "default", dtype: torch.dtype = torch.bfloat16, device: str = "cpu"):
        check_mode_name("sglang", mode)
        if device != "cpu" and os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
            os.environ["SGLANG_USE_CPU_ENGINE"] = "0"
        self.sglang = _import_sglang()
        self.mode, self.dtype, self.device = mode, dtype, device

    def _dispatch(self) -> str:
        try:
            from sglang.kernels.fused_op import _platform_key

            key = _platform_key()
        except ImportError:
            key = "?"
        return "forward_native" if key == "" else f"forward_{key}"

    def info(self) -> EngineInfo:
        from ..harness import device_name, machine_record

        settings: dict[str, Any] = {
            "SGLANG_USE_CPU_ENGINE": os.environ.get("SGLANG_USE_CPU_ENGINE", ""),
            "dispatch": self._dispatch(),
            **machine_record(self.device),
        }
        try:
            from sglang.srt.utils import cpu_has_amx_support

            settings["cpu_has_amx_support"] = bool(cpu_has_amx_support())
        except ImportError:
            pass
        return EngineInfo(
            name="sglang", version=self.sglang.__version__,
            backend="cuda" if self.device.startswith("cuda") else "cpu",
            device=device_name(self.device), torch_version=torch.__version__,
            execution_mode="eager" if self.mode == "default" else "torch-compile", settings=settings,
        )

    def regions(self) -> dict[str, RegionImpl | Unavailable]:
        from sglang.srt.layers.activation import SiluAndMul
        from sglang.srt.layers.layernorm import RMSNorm
        from sglang.srt.layers.rotary_embedding import get_rope

        kw: dict[str, Any] = {}
        if self.mode == "compiled":
            from sglang.kernels.spec import KernelBackend

            kw = {"backend": KernelBackend.TORCH_COMPILE}
        dtype, dev = self.dtype, self.device
        norms: dict[tuple, Any] = {}
        ropes: dict[tuple, Any] = {}
        act = SiluAndMul()

        def norm_for(hidden, eps, weight):
            key = (hidden, eps)
            if key not in norms:
                # The engine builds layers with torch's default dtype set to the model dtype.
                old = torch.get_default_dtype()
                torch.set_default_dtype(dtype)
                try:
                    norms[key] = RMSNorm(hidden, eps=eps).to(dev)
                finally:
                    torch.set_default_dtype(old)
            n = norms[key]
            with torch.no_grad():
                n.weight.copy_(weight)
            return n

        def rmsnorm(x, weight, eps):
            with torch.no_grad():
                return norm_for(x.shape[-1], eps, weight)(x, **kw)

        def add_rmsnorm(x, residual, weight, eps):
            with torch.no_grad():
                out, res = norm_for(x.shape[-1], eps, weight)(x, residual, **kw)
            return out, res

        def swiglu(gate, up):
            with torch.no_grad():
                return act(torch.cat((gate, up), dim=-1), **kw)

        def rope(positions, q, k, *, base, style):
            t, hq, d = q.shape
            hk = k.shape[1]
            key = (d, base, style)
            if key not in ropes:
                ropes[key] = get_rope(d, d, 1 << 17, int(base) if float(base).is_integer() else base,
                                      is_neox_style=style == "neox", dtype=dtype).to(dev)
            with torch.no_grad():
                qo, ko = ropes[key](positions, q.reshape(t, hq * d), k.reshape(t, hk * d), **kw)
            return qo.reshape(t, hq, d), ko.reshape(t, hk, d)

        how = f"{self._dispatch()}, engine dispatch" if self.mode == "default" else "torch.compile backend"
        return {
            "rope": RegionImpl(rope, f"sglang get_rope RotaryEmbedding ({how})"),
            "swiglu": RegionImpl(swiglu, f"sglang SiluAndMul ({how})"),
            "add_rmsnorm": RegionImpl(add_rmsnorm, f"sglang RMSNorm with residual ({how})"),
            "rmsnorm": RegionImpl(rmsnorm, f"sglang RMSNorm ({how})"),
        }

    def moe(self) -> RegionImpl | Unavailable:
        """An unquantized sparse MoE block as SGLang's CPU engine runs it, from the router logits on:
        its ``TopK`` layer's native path (``select_experts`` with ``torch_native``, what ``forward_native``
        sets; SGLang's CPU engine dispatches its layers to ``forward_native`` without AMX), then, on a
        host without AMX, its unquantized MoE method's ``forward_cpu``: ``moe_forward_native`` (with AMX
        it calls sgl_kernel's ``fused_experts_cpu``, which this CPU build does not carry)."""
        if self.device != "cpu":
            return Unavailable(f"the MoE experts are probed op-level on CPU only (device {self.device})")
        if self.mode != "default":
            return Unavailable("the MoE experts are probed in the default mode")
        from sglang.srt.utils import cpu_has_amx_support

        if cpu_has_amx_support():
            return Unavailable("this CPU has AMX: SGLang runs the experts in sgl_kernel's fused_experts_cpu, which "
                               "the CPU build used here does not carry")
        try:
            from sglang.srt.layers.moe.fused_moe_native import moe_forward_native
            from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
            from sglang.srt.layers.moe.topk import TopKConfig, select_experts
        except ImportError as e:  # pragma: no cover - another SGLang layout
            return Unavailable(f"SGLang's native MoE forward is not importable here ({e})")

        class _Layer:  # the attributes moe_forward_native reads from a FusedMoE layer
            def __init__(self, w13, w2):
                self.w13_weight, self.w2_weight, self.num_experts = w13, w2, w13.shape[0]

        def moe(x, w13, w2, router_logits, topk, *, renormalize=True):
            cfg = MoeRunnerConfig(num_experts=w13.shape[0], top_k=topk, activation="silu")
            with torch.no_grad():
                topk_output = select_experts(hidden_states=x, router_logits=router_logits, layer_id=0,
                                             topk_config=TopKConfig(top_k=topk, renormalize=renormalize,
                                                                    torch_native=True))
                return moe_forward_native(_Layer(w13, w2), x, topk_output, cfg)

        return RegionImpl(moe, f"sglang select_experts (TopK, torch_native), then moe_forward_native "
                          f"(UnquantizedFusedMoEMethod.forward_cpu without AMX, {self._dispatch()})",
                          [f"called outside the engine with {torch.get_num_threads()} threads"])

    def shared_expert(self) -> RegionImpl | Unavailable:
        """Qwen2-MoE's shared expert in SGLang's CPU engine: on a host without AMX its sparse MoE block
        gates the shared expert with ``fused_gate_sigmoid_mul_add``, a Triton GPU kernel (with AMX,
        sgl_kernel's ``fused_linear_sigmoid_mul``, which the CPU build used here does not carry). The
        kernel is called here on CPU tensors, as the block would call it: where it cannot run, the
        entry is unavailable with the error; where it runs, its rounding is not modelled (not probed)."""
        from sglang.srt.utils import cpu_has_amx_support

        if cpu_has_amx_support():
            return Unavailable("this CPU has AMX: SGLang gates the shared expert with sgl_kernel's "
                               "fused_linear_sigmoid_mul, which the CPU build used here does not carry")
        try:
            from sglang.kernels.ops.elementwise.elementwise import fused_gate_sigmoid_mul_add
        except ImportError as e:  # pragma: no cover - another SGLang layout
            return Unavailable(f"SGLang's shared-expert gate kernel is not importable here ({e})")
        x = torch.ones(2, 64, dtype=self.dtype)
        try:
            fused_gate_sigmoid_mul_add(x, x[0].clone(), x.clone(), x.clone())
        except Exception as e:  # noqa: BLE001 - the kernel's launch failure is what is recorded
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            return Unavailable(f"SGLang's Qwen2-MoE block gates the shared expert with fused_gate_sigmoid_mul_add, "
                               f"a Triton GPU kernel, which cannot run on this CPU without AMX ({type(e).__name__}: "
                               f"{first[:160]}): SGLang cannot run a Qwen2-MoE model here")
        return Unavailable("SGLang's fused_gate_sigmoid_mul_add ran on this device; its rounding (the gate's "
                           "logit, sigmoid and sum in one kernel) is not modelled by the shared_expert entry: not probed")

    def attention_cases(self) -> tuple[tuple, ...]:
        return ATTENTION_CASES

    def attention(self) -> RegionImpl | Unavailable:
        """The attention SGLang's CPU engine runs on a host without AMX: its ``torch_native`` backend
        (``intel_amx`` needs AMX and the sgl_kernel CPU build; SGLang falls back by itself), called
        the way the backend calls it: K/V in a token pool gathered through ``req_to_token``,
        ``_run_sdpa_forward_extend`` for a prefill (queries after a cached prefix when Tq < Tk) and
        ``_run_sdpa_forward_decode`` for one query, GQA through ``enable_gqa``."""
        if self.device != "cpu":
            return Unavailable(f"attention is probed op-level on CPU only (device {self.device})")
        if self.mode != "default":
            return Unavailable("attention is probed in the default mode (the compiled mode compiles the layers, "
                               "not the attention backend)")
        try:
            from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        except ImportError as e:  # pragma: no cover - another SGLang layout
            return Unavailable(f"SGLang's torch_native attention backend is not importable here ({e})")
        backend = object.__new__(TorchNativeAttnBackend)  # its sdpa helpers read no state but the arguments

        def attention(q, k, v, *, scale):
            tq, hq, d = q.shape
            tk, hk, _ = k.shape
            out = torch.empty(tq, hq, v.shape[-1], dtype=q.dtype)
            pool = 3  # the pool's token slots: the sequence's tokens after a few unused ones, as in the engine
            k_cache = torch.zeros(pool + tk, hk, d, dtype=k.dtype)
            v_cache = torch.zeros(pool + tk, hk, v.shape[-1], dtype=v.dtype)
            k_cache[pool:], v_cache[pool:] = k, v
            req_to_token = torch.arange(pool, pool + tk, dtype=torch.int64)[None]
            args = dict(k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token,
                        req_pool_indices=torch.zeros(1, dtype=torch.int64),
                        seq_lens=torch.tensor([tk], dtype=torch.int64), scaling=float(scale), enable_gqa=hq != hk,
                        causal=True)
            with torch.no_grad():
                if tq == 1:
                    backend._run_sdpa_forward_decode(q.contiguous(), out, **dict(args, causal=False))
                else:
                    backend._run_sdpa_forward_extend(
                        q.contiguous(), out, extend_prefix_lens=torch.tensor([tk - tq], dtype=torch.int64),
                        extend_seq_lens=torch.tensor([tq], dtype=torch.int64), **args)
            return out

        return RegionImpl(
            attention,
            "sglang torch_native attention backend (TorchNativeAttnBackend._run_sdpa_forward_extend / _decode: "
            f"torch.nn.functional.scaled_dot_product_attention on CPU, torch {torch.__version__}, "
            f"{torch.backends.cpu.get_cpu_capability()})",
            [f"called outside the engine with the backend's own helpers, {torch.get_num_threads()} threads; the "
             "engine's default on a CPU without AMX (intel_amx falls back to torch_native)"],
        )
