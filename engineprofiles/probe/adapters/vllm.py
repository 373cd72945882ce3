"""vLLM: its own layer classes, run the way the engine runs them on this device.

The execution mode is read from vLLM's own default configuration (``VllmConfig()`` after the
platform hook), not guessed. On vLLM's CPU build that is whole-model compilation with
torch.compile + Inductor, custom ops off (``forward_native``); each region is compiled through
vLLM's own ``support_torch_compile`` wrapper, the mechanism the engine applies to the model, with
the token dimension dynamic. ``mode="eager"`` is the engine with ``enforce_eager`` (compilation
mode NONE): custom ops on, each layer dispatching to its CPU kernel.

A region compiled alone can round differently from the same region inside the compiled model
(fusion spans layers); the in-situ probe is the truth for that.
"""

from __future__ import annotations

import itertools

import os
from typing import Any, Callable

import torch

from ...engines import ENGINES
from ...names import check_mode_name
from ..base import Adapter, EngineInfo, EngineNotInstalled, RegionImpl, Unavailable

MODES = ENGINES["vllm"].modes
INSTALL_HINT = "scripts/engine_env.sh vllm 0.32.0"


def _import_vllm():
    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")  # no stale AOT artifacts from ~/.cache/vllm
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise EngineNotInstalled(
            f"vLLM is not installed in this Python environment ({e}). Make its environment with "
            f"`{INSTALL_HINT}` and run the probe there (probe-engine finds .engines/vllm-* by itself)."
        ) from None
    return vllm


class VllmAdapter(Adapter):
    name = "vllm"
    modes = MODES

    def __init__(self, mode: str = "default", dtype: torch.dtype = torch.bfloat16, device: str = "cpu"):
        check_mode_name("vllm", mode)
        self.vllm = _import_vllm()
        from vllm.config import CompilationConfig, VllmConfig
        from vllm.config.compilation import CompilationMode

        self.dtype, self.device = dtype, device
        default = VllmConfig()
        cc = default.compilation_config
        compiled_default = cc.mode not in (None, CompilationMode.NONE)
        if mode == "default":
            mode = "compiled" if compiled_default else "eager"
        self.mode = mode
        if mode == "compiled":
            if cc.mode in (None, CompilationMode.NONE):
                cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE)
                self.config = VllmConfig(compilation_config=cc)
            else:
                self.config = default
        else:
            self.config = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.NONE))
        self.cc = self.config.compilation_config
        self.default_mode = "compiled" if compiled_default else "eager"

    # -- engine description ------------------------------------------------------------------
    def info(self) -> EngineInfo:
        from ..harness import device_name, machine_record

        cc = self.cc
        settings: dict[str, Any] = {
            "compilation_mode": str(getattr(cc.mode, "name", cc.mode)),
            "compile_backend": str(cc.backend),
            "custom_ops": [str(c) for c in cc.custom_ops],
            "engine_default_mode": self.default_mode,
            **machine_record(self.device),
        }
        for k, v in sorted(dict(cc.inductor_compile_config).items()):
            if isinstance(v, (str, int, float, bool)):
                settings[f"inductor.{k}"] = v
        execution = "inductor" if self.mode == "compiled" else "eager"
        return EngineInfo(
            name="vllm",
            version=self.vllm.__version__,
            backend="cuda" if self.device.startswith("cuda") else "cpu",
            device=device_name(self.device),
            torch_version=torch.__version__,
            execution_mode=execution,
            settings=settings,
        )

    # -- the regions ---------------------------------------------------------------------------
    def _activate(self) -> None:
        k = getattr(self.config, "kernel_config", None)
        if k is not None and hasattr(k, "ir_op_priority"):
            k.ir_op_priority.set_default()  # what the worker does at start-up
        try:
            import vllm.ir as vir

            if hasattr(vir, "set_default_torch_wrap"):
                vir.set_default_torch_wrap(self.cc.ir_enable_torch_wrap)
        except ImportError:
            pass

    def _compiled(self, layer: torch.nn.Module, argnames: tuple[str, ...]) -> Callable[..., Any]:
        """Compile ``layer`` the way vLLM compiles a model on this platform.

        Read from the engine, as its compile wrapper (vllm/compilation/wrapper.py) does:
        ``torch.compile(fullgraph=True, dynamic=False, backend=cc.init_backend(...),
        options=cc.inductor_compile_config + guard_filter_fn)`` with the token dimension marked
        dynamic and all guards dropped (trace once, then run every token count on that graph).
        One compiled function (a fresh code object) per shape signature other than tokens.
        """
        cc, config = self.cc, self.config
        try:
            backend = cc.init_backend(config, prefix="probe")
        except TypeError:
            backend = cc.init_backend(config)
        options: dict[str, Any] = dict(cc.inductor_compile_config) if backend == "inductor" else {}
        skip = getattr(torch.compiler, "skip_all_guards_unsafe", None) or (lambda x: [False for _ in x])
        dsc = getattr(cc, "dynamic_shapes_config", None)
        if dsc is not None and getattr(dsc, "evaluate_guards", False):
            options["guard_filter_fn"] = lambda x: [e.guard_type == "SHAPE_ENV" for e in x]
        else:
            options["guard_filter_fn"] = skip
        try:
            from vllm.env_override import _apply_constrain_to_fx_strides_patch

            _apply_constrain_to_fx_strides_patch()
        except ImportError:
            pass
        patches: dict[str, Any] = {}
        if hasattr(torch._inductor.config, "assume_32bit_indexing"):
            patches["assume_32bit_indexing"] = getattr(dsc, "assume_32_bit_indexing", False) if dsc else False
        compiled: dict[tuple, Any] = {}
        args_text = ", ".join(argnames)

        def run(fn, args):
            for a in args:
                if isinstance(a, torch.Tensor) and a.dim() > 0:
                    torch._dynamo.mark_dynamic(a, 0)
            with torch._inductor.config.patch(**patches):
                return fn(*args)

        def call(*args):
            sig = tuple((tuple(a.shape[1:]), a.dtype) for a in args if isinstance(a, torch.Tensor))
            if sig not in compiled:
                ns: dict[str, Any] = {}
                exec(f"def region({args_text}):\n    return layer({args_text})\n", {"layer": layer}, ns)  # noqa: S102
                fn = torch.compile(ns["region"], fullgraph=True, dynamic=False, backend=backend, options=options)
                # Trace once with a symbolic token count (at least 2 tokens, so the size is
                # not specialized to 1), as the engine's warm-up does.
                warm = tuple(a.repeat(4, *([1] * (a.dim() - 1)))[:4].clone() if isinstance(a, torch.Tensor) else a for a in args)
                run(fn, warm)
                compiled[sig] = fn
            return run(compiled[sig], args)

        return call

    def regions(self) -> dict[str, RegionImpl | Unavailable]:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.activation import SiluAndMul
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.layers import rotary_embedding as rope_mod

        dtype, dev, compiled = self.dtype, self.device, self.mode == "compiled"
        config = self.config
        norms: dict[tuple, Any] = {}
        ropes: dict[tuple, Any] = {}
        how = "compiled as the engine compiles the model: torch.compile, inductor, no guards" if compiled else "eager"

        with set_current_vllm_config(config):
            self._activate()
            act_layer = SiluAndMul()
        act_call = self._compiled(act_layer, ("x",)) if compiled else None

        def norm_for(hidden: int, eps: float, weight: torch.Tensor):
            key = (hidden, eps)
            if key not in norms:
                with set_current_vllm_config(config):
                    layer = RMSNorm(hidden, eps=eps, dtype=dtype).to(dev)
                plain = self._compiled(layer, ("x",)) if compiled else None
                add = self._compiled(layer, ("x", "residual")) if compiled else None
                norms[key] = (layer, plain, add)
            layer, plain, add = norms[key]
            with torch.no_grad():
                layer.weight.copy_(weight)
            return layer, plain, add

        def rmsnorm(x, weight, eps):
            layer, plain, _ = norm_for(x.shape[-1], eps, weight)
            with set_current_vllm_config(config):
                return plain(x) if compiled else layer(x)

        def add_rmsnorm(x, residual, weight, eps):
            layer, _, add = norm_for(x.shape[-1], eps, weight)
            with set_current_vllm_config(config):
                out = add(x, residual) if compiled else layer(x, residual)
            return out[0], out[1]

        def swiglu(gate, up):
            x = torch.cat((gate, up), dim=-1)
            with set_current_vllm_config(config):
                return act_call(x) if compiled else act_layer(x)

        def rope(positions, q, k, *, base, style):
            t, hq, d = q.shape
            hk = k.shape[1]
            key = (d, base, style)
            if key not in ropes:
                rope_mod._ROPE_DICT.clear()  # get_rope caches instances with their dispatch choice
                with set_current_vllm_config(config):
                    layer = rope_mod.get_rope(d, 1 << 17, style == "neox", {"rope_theta": base}, dtype).to(dev)
                ropes[key] = (layer, self._compiled(layer, ("positions", "query", "key")) if compiled else None)
            layer, call = ropes[key]
            qf, kf = q.reshape(t, hq * d), k.reshape(t, hk * d)
            with set_current_vllm_config(config):
                qo, ko = call(positions, qf, kf) if compiled else layer(positions, qf, kf)
            return qo.reshape(t, hq, d), ko.reshape(t, hk, d)

        def method(layer) -> str:
            fm = getattr(layer, "_forward_method", None)
            return getattr(fm, "__qualname__", None) or type(layer).__name__

        with set_current_vllm_config(config):
            probe_norm = RMSNorm(8, dtype=dtype)
            probe_rope = rope_mod.get_rope(64, 256, True, {"rope_theta": 1e4}, dtype)
            rope_mod._ROPE_DICT.clear()
        notes = [f"engine default execution mode on this device: {self.default_mode}"]
        return {
            "rope": RegionImpl(rope, f"vllm {method(probe_rope)} ({how})", notes),
            "swiglu": RegionImpl(swiglu, f"vllm {method(act_layer)} ({how})", notes),
            "add_rmsnorm": RegionImpl(add_rmsnorm, f"vllm {method(probe_norm)} with residual ({how})", notes),
            "rmsnorm": RegionImpl(rmsnorm, f"vllm {method(probe_norm)} ({how})", notes),
        }

    # -- MoE experts ---------------------------------------------------------------------------
    def moe(self) -> RegionImpl | Unavailable:
        """An unquantized sparse MoE block as vLLM runs it on this device, from the router logits on:
        its CPU router's softmax top-k (plain torch ops, compiled with the model in the compiled
        mode, eager otherwise), then the first of the oracle's CPU expert classes (AMX, Arm, Power,
        then the portable vector one) that supports the device, its own weight prepacking and its
        fused kernel with the ISA the class names (an opaque op in the compiled graph: eager in
        both modes). CPU only."""
        if self.device != "cpu":
            return Unavailable(f"the MoE experts are probed op-level on CPU only (device {self.device})")
        try:
            from vllm import _custom_ops as ops
            from vllm.model_executor.layers.fused_moe.experts import cpu_moe
        except ImportError as e:  # pragma: no cover - another vLLM layout
            return Unavailable(f"vLLM's CPU fused-MoE experts are not importable here ({e})")
        order = [getattr(cpu_moe, n) for n in ("X86CPUUnquantizedExperts", "ArmCPUUnquantizedExperts",
                                               "PowerCPUUnquantizedExperts", "CPUUnquantizedExperts")
                 if hasattr(cpu_moe, n)]
        chosen = next((c for c in order if c._supports_current_device()), None)
        if chosen is None:
            return Unavailable("none of vLLM's unquantized CPU expert classes supports this device")
        isa = chosen.isa
        try:  # vLLM 0.32: the CPU router's softmax top-k; 0.28: the same code in cpu_moe.select_experts
            from vllm.model_executor.layers.fused_moe.router.cpu_router import _softmax_topk as softmax_topk
            router_path = "CPURouter's _softmax_topk"
        except ImportError:
            def softmax_topk(logits, k, renormalize):
                return cpu_moe.select_experts(logits, logits, k, False, renormalize)
            router_path = "cpu_moe.select_experts"

        class _Router(torch.nn.Module):
            def __init__(self, k: int, renormalize: bool):
                super().__init__()
                self.k, self.renormalize = k, renormalize

            def forward(self, logits):
                return softmax_topk(logits, self.k, self.renormalize)

        routers: dict[tuple[int, bool], Any] = {}
        compiled = self.mode == "compiled"

        def route(logits, k, renormalize):
            if (k, renormalize) not in routers:
                r = _Router(k, renormalize)
                routers[k, renormalize] = self._compiled(r, ("logits",)) if compiled else r
            return routers[k, renormalize](logits)

        def moe(x, w13, w2, router_logits, topk, *, renormalize=True):
            topk_weights, topk_ids = route(router_logits, topk, renormalize)
            out = torch.empty_like(x)
            # The op itself (its Python wrapper's signature changed between versions; the op's did not).
            torch.ops._C.cpu_fused_moe(out, x.contiguous(), ops.cpu_prepack_moe_weight(w13.contiguous(), isa),
                                       ops.cpu_prepack_moe_weight(w2.contiguous(), isa), None, None,
                                       topk_weights.to(torch.float32).contiguous(),
                                       topk_ids.to(torch.int32).contiguous(), False, "silu", isa)
            return out

        return RegionImpl(
            moe,
            f"vllm {router_path} ({'compiled as the engine compiles the model' if compiled else 'eager'}), then "
            f"{chosen.__name__} (torch.ops._C.cpu_fused_moe after prepack_moe_weight, isa {isa})",
            [f"called outside the engine with the expert class's own prepacking and kernel, {torch.get_num_threads()} "
             "threads; the experts run eagerly in both of vLLM's modes (an opaque op in the compiled graph); "
             "zentorch's MoE (used instead where zentorch is installed) is not probed"],
        )

    def _model_parallel(self) -> None:
        """vLLM's linear layers need its (tensor-)parallel groups: one process, world size 1, gloo."""
        import tempfile

        from vllm.distributed import parallel_state as ps

        if ps.model_parallel_is_initialized():
            return
        if not torch.distributed.is_initialized():
            fd, path = tempfile.mkstemp(prefix="probe-dist-")
            os.close(fd)
            os.unlink(path)
            ps.init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                            distributed_init_method=f"file://{path}", backend="gloo")
        ps.ensure_model_parallel_initialized(1, 1)

    def _moe_block_in_graph(self) -> bool | None:
        """Whether the engine's MoE layer runs its forward (router, shared expert, sum) as Python that
        the compiled model traces, or as an opaque custom op: the engine's own choice for this platform
        (``MoERunner._select_forward``: a function, or a ``torch.ops.vllm`` op). None: not found."""
        try:
            import types

            from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
        except ImportError:  # pragma: no cover - another vLLM layout
            return None
        entry = MoERunner._select_forward(types.SimpleNamespace(_shared_experts=object()))
        return not isinstance(entry, torch._ops.OpOverloadPacket)

    def shared_expert(self) -> RegionImpl | Unavailable:
        """Qwen2-MoE's shared expert as vLLM runs it: its own ``Qwen2MoeMLP`` with the
        ``shared_expert_gate`` (``ReplicatedLinear``) as ``expert_gate``, built under the engine's
        configuration (so ``SiluAndMul`` dispatches as the engine's does), then the block's
        ``shared_output + fused_output`` and the next decoder layer's input RMSNorm with the residual.
        In the compiled mode all of it is compiled as the engine compiles the model where the engine's
        MoE layer is traced into the graph (its choice on CPU, read from ``MoERunner``), else the
        shared expert runs eagerly (inside the opaque MoE op) and the sum and norm compiled; eager
        mode runs all of it eagerly. One fresh set of layers (and compiled function) per call: the
        CPU linear layers prepack their weights."""
        from vllm.config import set_current_vllm_config

        try:
            from vllm.model_executor.layers.layernorm import RMSNorm
            from vllm.model_executor.layers.linear import ReplicatedLinear
            from vllm.model_executor.models.qwen2_moe import Qwen2MoeMLP
        except ImportError as e:  # pragma: no cover - another vLLM layout
            return Unavailable(f"vLLM's Qwen2-MoE shared expert is not importable here ({e})")
        config, compiled = self.config, self.mode == "compiled"
        in_graph = self._moe_block_in_graph()
        if compiled and in_graph is None:
            return Unavailable("cannot tell whether vLLM's MoE layer is traced into the compiled graph here "
                               "(MoERunner._select_forward not found)")
        dtype = self.dtype

        class _Block(torch.nn.Module):
            def __init__(self, mlp: torch.nn.Module | None, norm: torch.nn.Module):
                super().__init__()
                self.mlp, self.norm = mlp, norm

            def forward(self, x, routed, residual):  # the shared expert, the block's sum, the next norm
                shared = self.mlp(x) if self.mlp is not None else x
                return self.norm(shared + routed, residual)[1]

        def build(x, w_gate_up, w_down, w_gate):
            h, i = x.shape[1], w_down.shape[1]
            with set_current_vllm_config(config):
                self._activate()
                self._model_parallel()
                gate = ReplicatedLinear(h, 1, bias=False, quant_config=None, prefix="probe.shared_expert_gate")
                mlp = Qwen2MoeMLP(h, i, "silu", reduce_results=False, expert_gate=gate,
                                  prefix="probe.shared_expert").to(dtype)
                norm = RMSNorm(h, eps=1e-6, dtype=dtype)
            with torch.no_grad():
                for layer, w in ((mlp.gate_up_proj, w_gate_up), (mlp.down_proj, w_down), (mlp.expert_gate, w_gate)):
                    layer.weight.data = w.contiguous().clone()
                    layer.quant_method.process_weights_after_loading(layer)
            return mlp, norm

        def shared_expert(x, w_gate_up, w_down, w_gate, routed, residual):
            mlp, norm = build(x, w_gate_up, w_down, w_gate)
            with torch.no_grad(), set_current_vllm_config(config):
                if not compiled:
                    return _Block(mlp, norm)(x, routed, residual)
                if in_graph:
                    return self._compiled(_Block(mlp, norm), ("x", "routed", "residual"))(x, routed, residual)
                shared = mlp(x)
                return self._compiled(_Block(None, norm), ("x", "routed", "residual"))(shared, routed, residual)

        with set_current_vllm_config(config):
            from vllm.model_executor.layers.activation import SiluAndMul

            fm = getattr(SiluAndMul(), "_forward_method", None)
        act = getattr(fm, "__qualname__", "SiluAndMul")
        if not compiled:
            how = "all eager"
        elif in_graph:
            how = ("all compiled as the engine compiles the model (torch.compile, inductor, no guards): on this "
                   "platform vLLM's MoE layer is traced into the graph (MoERunner._select_forward)")
        else:
            how = ("the shared expert eager (inside the opaque MoE op), the sum and norm compiled as the engine "
                   "compiles the model")
        return RegionImpl(
            shared_expert,
            f"vllm Qwen2MoeMLP with its expert_gate ({act}), then shared_output + fused_output into RMSNorm "
            f"with the residual ({how})",
            ["called outside the engine with vLLM's own layers (tensor parallel size 1, gloo), "
             f"{torch.get_num_threads()} threads"],
        )

    # -- attention ----------------------------------------------------------------------------
    def attention(self) -> RegionImpl | Unavailable:
        """The engine's attention backend kernel on this device, called the way its backend calls
        it: K/V written into a paged cache by the backend's own reshape-and-cache op, the
        backend's scheduler metadata, the ISA the backend picks for this dtype, block size and
        head dim. CPU only (the CUDA backends are other kernels)."""
        if self.device != "cpu":
            return Unavailable(f"attention is probed op-level on CPU only (device {self.device})")
        try:
            from vllm import _custom_ops  # noqa: F401  (the kernel's ops: cpu_attention)
            from vllm import envs
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa
        except ImportError as e:  # pragma: no cover - another vLLM layout
            return Unavailable(f"vLLM's CPU attention backend is not importable here ({e})")
        block_size = int(getattr(self.config.cache_config, "block_size", None) or 128)
        dtype = self.dtype
        split_kv = bool(getattr(envs, "VLLM_CPU_ATTN_SPLIT_KV", False))

        def attention(q, k, v, *, scale):
            return cpu_attention(q, k, v, scale=scale, split_kv=split_kv, block_size=block_size)

        isa = _get_attn_isa(dtype, block_size, 64)
        return RegionImpl(
            attention,
            f"vllm {CPUAttentionBackend.get_name()} kernel (torch.ops._C.cpu_attention_with_kv_cache, isa {isa} for "
            f"head dims that are multiples of 32, block size {block_size}, split-KV {'on' if split_kv else 'off'})",
            [f"called outside the engine with the backend's own ops and scheduler, {torch.get_num_threads()} "
             "threads; attention runs eagerly in both of vLLM's modes (the compiled graph calls it as an opaque op)"],
            settings={"attention_isa": str(isa)},
        )


# -- vLLM's CPU attention kernel, called as its backend calls it (the op-level probe, and exact mode's
# engine kernels: engineprofiles.engines names these as the record's exact_attention) -----------------

BLOCK_SIZE = 128  # vLLM's CPU KV cache block size by default


def attention_isa(dtype: torch.dtype, head_dim: int, block_size: int = BLOCK_SIZE) -> str:
    """The ISA vLLM's CPU attention backend picks here for ``dtype`` and ``head_dim`` (vec, amx, ...)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(dtype, block_size, head_dim))


def cpu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, split_kv: bool = False,
                  block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """vLLM's CPU attention kernel on one request (:func:`cpu_attention_batch` of one): q [Tq, Hq, D] are the
    last Tq of the Tk positions of k, v [Tk, Hk, D] (causal); returns [Tq, Hq, D] in q's dtype."""
    return cpu_attention_batch([(q, k, v)], scale=scale, split_kv=split_kv, block_size=block_size)[0]


def cpu_attention_batch(requests: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], *, scale: float,
                        split_kv: bool = False, block_size: int = BLOCK_SIZE) -> list[torch.Tensor]:
    """vLLM's CPU attention kernel (``torch.ops._C.cpu_attention_with_kv_cache``) in one call over several
    requests, as its backend calls it for one step of a batch: each request's K/V written into its own blocks
    of a paged cache by the backend's reshape-and-cache op, the queries concatenated in the requests' order,
    the backend's scheduler metadata for the whole call (``split_kv``: ``VLLM_CPU_ATTN_SPLIT_KV``; the split
    follows torch's thread count and every request's length), the ISA it picks. Each request is (q [Tq, Hq, D],
    k, v [Tk, Hk, D]), q the last Tq of its Tk positions (causal); returns each request's [Tq, Hq, D]."""
    from vllm import _custom_ops as ops

    q0, k0 = requests[0][0], requests[0][1]
    dtype, hq, d, hk = q0.dtype, q0.shape[1], q0.shape[2], k0.shape[1]
    isa = attention_isa(dtype, d, block_size)
    tqs = [q.shape[0] for q, _, _ in requests]
    tks = [k.shape[0] for _, k, _ in requests]
    nblocks = [(tk + block_size - 1) // block_size for tk in tks]
    cache = torch.zeros(sum(nblocks), hk, block_size, 2 * d, dtype=dtype)
    key_cache, value_cache = cache.view(sum(nblocks), hk, 2 * block_size, d).chunk(2, dim=2)
    table = torch.zeros(len(requests), max(nblocks), dtype=torch.int32)
    slots, first = [], 0
    for r, (tk, nb) in enumerate(zip(tks, nblocks)):  # request r's blocks follow the previous request's
        table[r, :nb] = torch.arange(first, first + nb, dtype=torch.int32)
        slots.append(torch.arange(tk, dtype=torch.int64) + first * block_size)
        first += nb
    ops.cpu_attn_reshape_and_cache(torch.cat([k for _, k, _ in requests]).contiguous(),
                                   torch.cat([v for _, _, v in requests]).contiguous(), key_cache, value_cache,
                                   torch.cat(slots), isa)
    qsl = torch.tensor([0, *itertools.accumulate(tqs)], dtype=torch.int32)
    seq_lens = torch.tensor(tks, dtype=torch.int32)
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(requests), num_heads=hq, num_kv_heads=hk, head_dim=d, seq_lens=seq_lens, dtype=dtype,
        query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=split_kv)
    out = torch.empty(sum(tqs), hq, d, dtype=dtype)
    ops.cpu_attention_with_kv_cache(
        query=torch.cat([q for q, _, _ in requests]).contiguous(), key_cache=key_cache, value_cache=value_cache,
        output=out, query_start_loc=qsl, seq_lens=seq_lens, scale=float(scale), causal=True, alibi_slopes=None,
        sliding_window=-1, block_table=table, softcap=0.0, scheduler_metadata=sched, s_aux=None)
    return list(out.split(tqs))
