"""The forwards apply_profile binds on a model's own modules (one factory per module kind).

Each takes the profile's points (resolved once by apply_profile) and its activation dtype, not the
profile: the forwards are also traced by torch.compile, which must not walk the profile's schema.
While torch.compile traces them, the HF code around the regions runs as opaque ops
(:mod:`.opaque`), so that the compiled model computes the eager patched model's bits."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from engineprofiles.regions import FP32, Point, RopeFrequencies, route

from .. import functional as F
from ..errors import ProfileMismatch, ResidualStreamLost, StackNotCompiled
from . import opaque
from .carry import carry
from .families import FAMILIES
from .guard import checkpointing_message, refusal, refusal_as


def norm_plain(point: Point, act: torch.dtype, *, to_act: bool, backend: str | None = None):
    """A plain RMSNorm site (first layer's input norm, q/k norms). ``to_act``: the output feeds a
    matmul, so an FP32 ``output`` site is rounded there (RNE, as the matmul's input)."""

    def forward(self, hidden_states):
        # .to(act): FP32 master weights (mixed precision) compute with their rounded copy, as the
        # engine's BF16 weights; a no-op on weights stored in the activation dtype.
        y = F.rmsnorm(hidden_states, self.weight.to(act), self.variance_epsilon, point, dtype=act, backend=backend)
        return y.to(act) if to_act and y.dtype != act else y

    return forward


def mlp(point: Point, act: torch.dtype, path: str = "mlp", profile_name: str = ""):
    wrong_dtype = wrong_compute_dtype(path, act, profile_name)

    def forward(self, x):
        gate, up = opaque.linear(self.gate_proj, x), opaque.linear(self.up_proj, x)
        if gate.dtype == torch.float32:  # the matmul ran in FP32 (mixed precision without autocast)
            wrong_dtype()
        return opaque.linear(self.down_proj, F.swiglu(gate, up, point, dtype=act))

    return forward


def moe_block(point: Point, act: torch.dtype, path: str = "mlp", profile_name: str = "",
              shared: Point | None = None):
    """A sparse MoE block (router ``gate``, ``experts``) whose experts compute at the profile's
    ``moe`` point (``point``). The router runs as HF's module (its hooks, e.g. the recorded
    ``router_logits``, see it unchanged); its top-k weights reach the experts in FP32, computed as
    the point's ``router`` variant says, when the point keeps ``routing_weight`` FP32 or routes
    otherwise than HF (the experts op rounds them where the point says), else as the router returns
    them (HF's FP32 weights rounded to the activation dtype).

    ``shared``: the profile's ``shared_expert`` point, for a block with a shared expert (Qwen2-MoE:
    ``shared_expert``, ``shared_expert_gate``): the block returns ``m = routed + sigmoid(gate(x)) *
    shared_expert(x)`` at that point (``functional.shared_expert`` on the routed experts' output),
    in FP32 where the point keeps ``sum`` FP32 (the decoder layer hands it to the next residual add
    unrounded), else in the activation dtype. The shared expert's Linear modules are not called:
    their weights are read (families.py refuses wrapped ones)."""
    wrong_dtype = wrong_compute_dtype(path, act, profile_name)
    refuse_compile = refusal(
        f"{path}: a patched sparse MoE block computes its experts eagerly (the routed experts are found at run "
        "time), and its router's FP32 softmax compiled by Inductor would not compute eager's bits; run a patched "
        "MoE model eagerly")
    fp32_weights = point["routing_weight"] == FP32 or point["router"] != "softmax_all"

    def forward(self, hidden_states):
        if torch.compiler.is_compiling():
            refuse_compile()
        experts, router = self.experts, self.gate
        if not computes_in(act, experts.gate_up_proj):
            wrong_dtype()
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits, weights, ids = router(x)
        if fp32_weights:  # the reference's router on HF's logits (differentiable in them), FP32 weights
            weights, ids = route(logits, ids.shape[-1], point, renormalize=router.norm_topk_prob)
        # .to(act): FP32 master weights (mixed precision) compute with their rounded copy.
        out = F.moe(x, experts.gate_up_proj.to(act), experts.down_proj.to(act), weights, ids, point, dtype=act)
        if shared is not None:
            se = self.shared_expert
            w_gate_up = torch.cat((se.gate_proj.weight.to(act), se.up_proj.weight.to(act)))
            out = F.shared_expert(x, w_gate_up, se.down_proj.weight.to(act), self.shared_expert_gate.weight.to(act),
                                  out, shared, dtype=act)
        return out.reshape(shape)

    return forward


def cos_sin(rope: RopeFrequencies, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 cos/sin [*position_ids.shape, rotary_dim / 2] as the engines compute them (the opaque op when compiled)."""
    if torch.compiler.is_compiling():
        return opaque.rope_cos_sin_op(position_ids, *rope.args())
    return rope.cos_sin(position_ids)


def rotary(rope: RopeFrequencies):
    def forward(self, x, position_ids):
        # FP32 cos/sin, in HF's layout [batch, tokens, rotary_dim] (halves repeated); the RoPE
        # region's cos_sin site decides whether they are rounded.
        cos, sin = cos_sin(rope, position_ids)
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    return forward


def embedding(inline: bool = False):
    """The token embedding (a plain nn.Embedding): itself eagerly, the opaque op when compiled;
    ``inline`` (a stack compiled whole, as an engine compiles it): the gather traced, eager's gradient."""

    def forward(self, ids):
        if torch.compiler.is_compiling():
            return opaque.gather_embedding(self, ids) if inline else opaque.embedding(self, ids)
        return torch.nn.Embedding.forward(self, ids)

    return forward


def attention(point: Point, act: torch.dtype, qk_norm: bool, eager_attention: Callable[..., Any], family: str,
              path: str, exact: Any = None, rope: RopeFrequencies | None = None, profile_name: str = "",
              kv_split: Any = None, kernels: str = ""):
    """The attention module's forward: RoPE at the profile's point; then HF's attention function, or
    in exact mode (``exact``: the profile's attention point) the engine's attention. ``rope``: the
    frequencies of the patched rotary embedding, to recompute FP32 cos/sin that were cast on the way."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    window_of = FAMILIES[family].sliding_window

    refuse_implementation = refusal(
        f"{path}: a patched model compiles with HF's attention implementations "
        f"{', '.join(opaque.ATTENTION_IMPLEMENTATIONS)} (run as an opaque op, as eager runs them); this model uses "
        "another one. Load the model with attn_implementation='sdpa', apply the profile with exact=True, or run the "
        "patched model eagerly")
    refuse_dropout = refusal(
        f"{path}: attention dropout in training is random, and the compiled patch recomputes attention in the "
        "backward, so it cannot reproduce eager's bits; set config.attention_dropout = 0.0 (engines have none), "
        "or run the patched model eagerly")

    wrong_dtype = wrong_compute_dtype(path, act, profile_name)
    cast_away = refusal_as(ProfileMismatch, (
        f"{path}: the rotary embedding's FP32 cos/sin reached the attention cast to another dtype (e.g. by FSDP2's "
        "cast_forward_inputs) and no position_ids came with them to recompute them; pass position_ids, or shard "
        "with MixedPrecisionPolicy(cast_forward_inputs=False)"))

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                position_ids=None, **kwargs):
        kwargs["position_ids"] = position_ids  # for the attention function, as HF passes it
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = opaque.linear(self.q_proj, hidden_states).view(hidden_shape)
        if q.dtype == torch.float32:  # the matmul ran in FP32 (mixed precision without autocast)
            wrong_dtype()
        k = opaque.linear(self.k_proj, hidden_states).view(hidden_shape)
        v = opaque.linear(self.v_proj, hidden_states).view(hidden_shape).transpose(1, 2)
        if qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)  # may hand FP32 on to RoPE
        cos, sin = position_embeddings
        half = cos.shape[-1] // 2
        cos, sin = cos[..., :half], sin[..., :half]
        if cos.dtype != torch.float32 and rope is not None:
            # The patched rotary embedding hands FP32 cos/sin to the layers; something between
            # (FSDP2's cast_forward_inputs) cast them. Recompute them from the positions, as it did.
            if position_ids is None:
                cast_away()
            cos, sin = cos_sin(rope, position_ids)
            cos, sin = cos.to(hidden_states.device), sin.to(hidden_states.device)
        q = F.rope(q, cos, sin, point, style="neox", dtype=act).transpose(1, 2)
        k = F.rope(k, cos, sin, point, style="neox", dtype=act).transpose(1, 2)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        if exact is not None:
            out = F.attention(q, k, v, exact, scale=self.scaling, attention_mask=attention_mask,
                              kv_split=kv_split, kernels=kernels).transpose(1, 2)
            out = out.reshape(*input_shape, -1).contiguous()
            return opaque.linear(self.o_proj, out), None
        if torch.compiler.is_compiling():
            impl = self.config._attn_implementation
            if impl not in opaque.ATTENTION_IMPLEMENTATIONS:
                refuse_implementation()
            if self.training and self.attention_dropout:
                refuse_dropout()
            is_causal = kwargs.get("is_causal")
            is_causal = getattr(self, "is_causal", True) if is_causal is None else is_causal
            out = opaque.hf_attention_op(q, k, v, attention_mask, impl, family, self.num_key_value_groups,
                                         bool(is_causal), float(self.scaling))
            return opaque.linear(self.o_proj, out.reshape(*input_shape, -1).contiguous()), None
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention)
        window = window_of(self)
        extra = {"sliding_window": window} if hasattr(self, "sliding_window") or window is not None else {}
        out, weights = attention_interface(
            self, q, k, v, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling, **extra, **kwargs,
        )
        out = out.reshape(*input_shape, -1).contiguous()
        return opaque.linear(self.o_proj, out), weights

    return forward


STREAM_LOST = (
    "{path}: this decoder layer's input was not produced by the patched layer before it, so the engine's fused "
    "residual add cannot be reproduced. Something between the layers replaced the hidden state with other values "
    "(a hook returning a new tensor, a layer called on its own); run the layers in order through the model's "
    "forward and do not change the hidden states between them (a cast of the stream, e.g. FSDP2's "
    "cast_forward_inputs, is recognized)"
)
FINAL_LOST = (
    "{path}: the final norm's input was not produced by the last patched decoder layer, so the engine's fused "
    "residual add cannot be reproduced; call it through the model's forward"
)


def computes_in(act: torch.dtype, weight: Any) -> bool:
    """Whether a module with this weight computes in ``act``: weights stored in it, or FP32 master
    weights under ``torch.autocast(dtype=act)`` (FSDP2's MixedPrecisionPolicy hands the forward
    weights already cast to its param_dtype). What is not a floating-point tensor (quantized storage,
    which the module dequantizes to its own compute dtype; a module without the weight) is not judged."""
    if not isinstance(weight, torch.Tensor) or weight.dtype == act or not weight.is_floating_point():
        return True
    dev = weight.device.type
    return torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) == act


def _matmul_weight(layer: torch.nn.Module) -> Any:
    """A weight of the layer's first matmul (q_proj), None when the layer has none."""
    return getattr(getattr(getattr(layer, "self_attn", None), "q_proj", None), "weight", None)


def wrong_compute_dtype(path: str, act: torch.dtype, profile_name: str):
    """The refusal of a patched module whose matmuls computed in another dtype than the profile's (FP32
    master weights without autocast or FSDP2's param_dtype): raised outside traced code."""
    a = str(act).removeprefix("torch.")
    return refusal_as(ProfileMismatch, (
        f"{path}: the model computes in float32 (its weights are float32 and no torch.autocast(dtype=torch.{a}) is "
        f"active here), but profile {profile_name} rounds to {a}: the profile's dtype is the compute dtype. Run the "
        f"forward under torch.autocast(device_type=..., dtype=torch.{a}), shard the model with FSDP2 "
        f"fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.{a})), or load it in {a}"))


def layer(point: Point, act: torch.dtype, path: str, backend: str | None = None, profile_name: str = ""):
    """The decoder layer with the engine's residual path; ``point``: the add_rmsnorm point;
    ``backend``: the norms' emulator backend (exact mode: ``reference-inductor`` for an engine that
    compiles). The per-model state lives on the module, not in this closure (so that a deepcopy of
    the model has its own): ``self._emulator_stash`` (the decoder's :class:`Stash`) and
    ``self._emulator_first`` (the first layer normalizes its input without an add)."""
    refuse_checkpointing = refusal(checkpointing_message(path))
    lost = refusal_as(ResidualStreamLost, STREAM_LOST.format(path=path))
    wrong_dtype = wrong_compute_dtype(path, act, profile_name)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs):
        if torch.compiler.is_compiling() and getattr(self, "gradient_checkpointing", False) and self.training:
            refuse_checkpointing()  # a layer compiled alone (the whole model refuses before, guard.py)
        if not computes_in(act, _matmul_weight(self)):
            wrong_dtype()
        stash = self._emulator_stash
        if self._emulator_first:
            # The embedding of FP32 master weights (mixed precision: autocast does not cast an
            # embedding) is rounded to the activation dtype, as the engine stores it; a no-op else.
            hidden_states = hidden_states.to(act)
            residual = hidden_states
            x = self.input_layernorm(hidden_states)  # plain RMSNorm: no add before the first layer
        else:
            carried = stash.get(hidden_states)
            if carried is None:
                lost()
            m, r = carry(hidden_states, carried)
            ln = self.input_layernorm
            x, residual = F.add_rmsnorm(m, r, ln.weight.to(act), ln.variance_epsilon, point, dtype=act, backend=backend)
        a, _ = self.self_attn(
            hidden_states=x, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs,
        )
        ln = self.post_attention_layernorm
        x2, residual = F.add_rmsnorm(a, residual, ln.weight.to(act), ln.variance_epsilon, point, dtype=act,
                                     backend=backend)
        m = self.mlp(x2)
        if m.dtype == torch.float32 and residual.dtype != torch.float32:
            # A sparse block's FP32 output (shared_expert sum=fp32): h is what the next add computes
            # from it, round(m + residual), not round(round(m) + residual).
            h = (m + residual.float()).to(residual.dtype)
        else:
            h = m.to(residual.dtype) + residual
        stash.put(h, m, residual)
        return h

    return forward


def final_norm(point: Point, act: torch.dtype, path: str, backend: str | None = None):
    lost = refusal_as(ResidualStreamLost, FINAL_LOST.format(path=path))

    def forward(self, hidden_states):
        stash = self._emulator_stash
        carried = stash.get(hidden_states)
        if carried is None:
            lost()
        stash.last = None  # the end of the stream
        m, r = carry(hidden_states, carried)
        out, _ = F.add_rmsnorm(m, r, self.weight.to(act), self.variance_epsilon, point, dtype=act, backend=backend)
        return out

    return forward


def _install_output_capturing_hooks(stack: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """transformers installs its output-capturing hooks (``output_hidden_states``, ``output_attentions``)
    lazily, on the first call that asks for them, under a ``threading.Lock`` that Dynamo cannot trace;
    installed outside the graph, the compiled stack's first such call stays one graph (the hooks
    themselves trace). A no-op where transformers has no such hooks or the call asks for nothing."""
    asked = any(v for k, v in kwargs.items() if k.startswith("output_") and not isinstance(v, torch.Tensor)) or any(
        getattr(getattr(stack, "config", None), k, False) is True for k in ("output_hidden_states", "output_attentions"))
    if not asked or getattr(stack, "_output_capturing_hooks_installed", False):
        return
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # a transformers without lazily installed capture hooks
        return
    maybe_install_capturing_hooks(stack)


class _ValueOf(torch.autograd.Function):
    """``value``'s bits with ``carrier``'s gradient: the output of a forward computed twice, once in the
    graph that gives the engine's bits and once in the graph autograd differentiates."""

    @staticmethod
    def forward(ctx, carrier, value):  # type: ignore[override]
        return value.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


def _needs_grad(stack: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> bool:
    if not torch.is_grad_enabled():
        return False
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    return any(t.requires_grad for t in tensors) or any(p.requires_grad for p in stack.parameters())


def _with_values_of(grad_out: Any, value_out: Any) -> Any:
    """``value_out`` (a ModelOutput of the inference graph) with its hidden states carrying the gradient
    of ``grad_out``'s (the training graph's): bits of the former, gradient of the latter."""
    for key in ("last_hidden_state", "hidden_states"):
        v, g = getattr(value_out, key, None), getattr(grad_out, key, None)
        if isinstance(v, torch.Tensor) and isinstance(g, torch.Tensor):
            value_out[key] = _ValueOf.apply(g, v)
        elif isinstance(v, tuple) and isinstance(g, tuple) and len(v) == len(g):
            value_out[key] = tuple(_ValueOf.apply(a, b) if isinstance(a, torch.Tensor) and a.requires_grad else b
                                   for a, b in zip(g, v))
    return value_out


def compiled_stack(cls_forward: Callable[..., Any]):
    """The decoder stack's own forward (HF's ``<Family>Model.forward``, with the patched layers and
    norms inside), run as one torch.compile graph (Inductor, dynamic shapes, ``fullgraph``): exact mode
    for an engine that compiles its whole model with Inductor (vLLM's CPU build). The norms then trace
    inline (the ``reference-inductor`` backend under compile) and Inductor fuses the residual adds and
    the norms' reductions across the layers as it did in the engine's graph: which kernel re-reads the
    residual stream's BF16 pieces and which reads a realized FP32 sum decides how many lanes a norm's
    sum of squares runs in, and only the whole graph decides that. Linears, RoPE, SwiGLU and attention
    stay the opaque ops of a compiled patched model. Dynamic shapes: it compiles again only for another
    kind of call (a batch or a length of 1, as in decoding; grad mode; another model copy); torch.compile
    of the whole patched model by the user traces the stack into that graph instead.

    Where the stack cannot be one graph (gradient checkpointing: HF's checkpoint call breaks it), it
    runs eagerly, its norms compiled one at a time, with a :class:`~emulator.errors.StackNotCompiled`
    warning (once per model): a graph broken in pieces would not be the engine's graph either.

    With gradients (training), the graph Inductor compiles is another one: it saves activations for
    the backward, realizes other buffers and so fuses the norms otherwise (measured: 2 of 128 rollout
    log-probs off by an ULP with split-KV rows of 150-166 keys, tiny Qwen2, AVX512). The engine ran the
    inference graph, so the stack then runs twice: the inference graph gives the outputs' bits (and the
    KV cache), the training graph their gradient (:class:`_ValueOf`), its attention the cheap FP32
    formula (``ops.attention.gradient_pass``: the backward is FP32 attention's gradient either way).
    A call that passes a KV cache in runs once, in the training graph (both runs would append to it).
    Under the user's torch.compile the same holds: with gradients the stack leaves the user's graph (a
    graph break, which ``fullgraph=True`` refuses) and runs as these two graphs; without, it traces
    into the user's graph."""
    import weakref

    compiled = torch.compile(cls_forward, dynamic=True, fullgraph=True)
    eager: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # models whose stack did not compile

    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # the user compiles the model
            if _needs_grad(self, args, kwargs) and kwargs.get("past_key_values") is None:
                # training: the user's graph would be a training graph, other bits than the engine's: the
                # stack runs as exact mode's own graphs instead (a graph break; fullgraph=True refuses it)
                return outside(self, *args, **kwargs)
            return cls_forward(self, *args, **kwargs)  # inference: the stack is in that graph already
        return run(self, *args, **kwargs)

    def run(self, *args, **kwargs):
        from torch._dynamo import config as dynamo_config
        from torch._dynamo.exc import Unsupported

        if self in eager:
            return cls_forward(self, *args, **kwargs)
        _install_output_capturing_hooks(self, kwargs)
        try:
            # one graph per grad mode, model copy and kind of input: more than Dynamo's default of 8
            with dynamo_config.patch(cache_size_limit=1024, accumulated_cache_size_limit=4096, specialize_float=True):
                if not _needs_grad(self, args, kwargs) or kwargs.get("past_key_values") is not None:
                    return compiled(self, *args, **kwargs)
                from ..ops.attention import gradient_pass

                with torch.no_grad():
                    value_out = compiled(self, *args, **kwargs)
                with gradient_pass():  # only its gradient is used: FP32 attention, not the engine's arithmetic
                    grad_out = compiled(self, *args, **kwargs)
                return _with_values_of(grad_out, value_out)
        except Unsupported as e:
            eager.add(self)
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            ckpt = " (gradient checkpointing is on: HF's checkpoint call breaks the graph)" if any(
                getattr(m, "gradient_checkpointing", False) for m in self.modules()) else ""
            warnings.warn(
                f"exact mode: {type(self).__name__}'s decoder stack cannot be compiled as one graph{ckpt}: {reason}. "
                "It runs eagerly with its norms compiled one at a time, which on wider models does not reproduce "
                "the reduction order of an engine that compiles its whole model (vLLM's CPU build)"
                + ("; for engine-exact log-probs, score with gradient checkpointing off or the model in eval mode."
                   if ckpt else "."),
                StackNotCompiled, stacklevel=2)
            return cls_forward(self, *args, **kwargs)

    outside = torch.compiler.disable(run, reason=(
        "exact mode (an Inductor engine's profile) runs the decoder stack as its own graphs when gradients are "
        "on: the engine's bits come from the inference graph, the gradient from the training graph. Compile "
        "the model without fullgraph=True, or score without gradients"))
    return forward
