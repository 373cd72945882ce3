"""HF transformers: the trainer side, probed through the model family's own modules.

Each region is exercised through the module that runs it in a real forward pass, so a model
patched by ``emulator.apply_profile`` is probed the same way (the closed loop):

* rope: the attention module, with its projections fed the probe's q/k (Qwen3's q/k norms set
  aside) and an attention implementation that captures q/k after the rotary embedding; cos/sin
  come from the model's rotary embedding module.
* swiglu: the MLP, with gate/up projections returning the probe's tensors.
* rmsnorm: the first decoder layer's input norm (no add before it).
* add_rmsnorm: the decoder layer's own residual add feeding the post-attention norm: attention
  returns the probe's x, the MLP records its input (the norm output) and returns zeros, so the
  layer returns the residual it passes on.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from ...engines import ENGINES
from ...families import FAMILIES
from ...names import check_family_name, check_mode_name
from ..base import Adapter, EngineInfo, EngineNotInstalled, RegionImpl, Unavailable

CAPTURE = "engineprofiles_capture"


def _import():
    try:
        import transformers
    except ImportError as e:
        raise EngineNotInstalled(f"transformers is not installed ({e}); pip install transformers") from None
    return transformers


def family_classes(family: str):
    """The family's config class, decoder layer and rotary embedding on the installed transformers."""
    fam = FAMILIES[check_family_name(family)]
    classes = fam.classes()
    return getattr(_import(), fam.config), classes["layer"], classes["rotary"]


def _capture_fn(module, query, key, value, attention_mask, **kwargs):
    module._engineprofiles_qk = (query, key)
    b, h, t, d = query.shape
    return torch.zeros(b, t, h, d, dtype=query.dtype, device=query.device), None


def _register_capture() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if CAPTURE not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(CAPTURE, _capture_fn)


class _Returns(torch.nn.Module):
    """Stands in for a projection: returns a fixed tensor whatever it is given."""

    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.value = value

    def forward(self, x):
        return self.value


class _Record(torch.nn.Module):
    """Stands in for the MLP: records its input, returns zeros of the same shape."""

    def __init__(self):
        super().__init__()
        self.seen: torch.Tensor | None = None

    def forward(self, x):
        self.seen = x
        return torch.zeros_like(x)


@contextlib.contextmanager
def _swap(module: torch.nn.Module, **parts: Any) -> Iterator[None]:
    old = {k: module._modules.get(k, getattr(module, k, None)) for k in parts}
    try:
        for k, v in parts.items():
            setattr(module, k, v)
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


@contextlib.contextmanager
def _weight(norm: torch.nn.Module, w: torch.Tensor) -> Iterator[None]:
    old = norm.weight.detach().clone()
    with torch.no_grad():
        norm.weight.copy_(w)
    try:
        yield
    finally:
        with torch.no_grad():
            norm.weight.copy_(old)


def find_decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "self_attn") and hasattr(m, "mlp") and hasattr(m, "input_layernorm")]


class TransformersAdapter(Adapter):
    name = "transformers"
    modes = ENGINES["transformers"].modes

    def __init__(self, mode: str = "default", dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                 family: str | None = None, model: torch.nn.Module | None = None, label: str | None = None):
        check_mode_name("transformers", mode)
        self.tf = _import()
        _register_capture()
        self.dtype, self.device, self.model, self.label = dtype, device, model, label
        if model is not None:
            layers = find_decoder_layers(model)
            if not layers:
                raise ValueError(f"{type(model).__name__} has no decoder layers (modules with self_attn, mlp, input_layernorm)")
            self.layer = layers[0]
            self.config = self.layer.self_attn.config
            rot = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
            if not rot:
                raise ValueError(f"{type(model).__name__} has no rotary embedding module")
            self.rotary = rot[0]
            self.family = self.config.model_type
        else:
            self.family = family or "qwen2"
            family_classes(self.family)  # validates

    def info(self) -> EngineInfo:
        from ..harness import device_name, machine_record

        settings: dict[str, Any] = {"family": self.family}
        settings.update(machine_record(self.device))  # torch's CPU kernels dispatch by ISA
        mode = "eager"
        if self.model is not None:
            settings["model_class"] = type(self.model).__name__
            if self.label:
                settings["patched_with"] = self.label
                mode = "patched"
        return EngineInfo(
            name="transformers", version=self.tf.__version__,
            backend="cuda" if self.device.startswith("cuda") else "cpu",
            device=device_name(self.device), torch_version=torch.__version__, execution_mode=mode, settings=settings,
        )

    def sweep(self, region: str) -> list[dict[str, Any]] | None:
        if self.model is None:
            return None
        c = self.config
        hd = getattr(self.layer.self_attn, "head_dim", None) or c.hidden_size // c.num_attention_heads
        theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", 10000.0))
        eps = c.rms_norm_eps
        if region == "rope":
            return [dict(tokens=t, q_heads=c.num_attention_heads, kv_heads=c.num_key_value_heads, head_dim=hd,
                         style="neox", max_pos=mp, base=float(theta)) for t, mp in ((1, 8), (7, 4096), (64, 40000))]
        if region == "swiglu":
            return [dict(tokens=t, inter=c.intermediate_size) for t in (1, 7, 64)]
        return [dict(tokens=t, hidden=c.hidden_size, eps=eps) for t in (1, 7, 64)]

    def attention(self) -> RegionImpl | Unavailable:
        return _attention(self)

    def moe(self) -> RegionImpl | Unavailable:
        """Qwen3-MoE's sparse MoE block as HF runs it, from the router logits on: its router
        (Qwen3MoeTopKRouter: softmax in FP32, top-k, renormalized, cast to the activation dtype),
        fed the logits through an identity gate, then the experts module of a model built the way
        ``from_config``/``from_pretrained`` build it (HF then picks its default experts
        implementation for the device, read back into the path). With a given model: its first
        router and experts modules (the router's gate weight swapped for the identity meanwhile)."""
        from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

        # the family's own MoE classes (Qwen2-MoE's or Qwen3-MoE's; any other family: Qwen3-MoE's)
        MoeConfig = Qwen2MoeConfig if self.family == "qwen2_moe" else Qwen3MoeConfig
        prefix = "Qwen2Moe" if self.family == "qwen2_moe" else "Qwen3Moe"
        given = given_router = None
        if self.model is not None:
            given = next((m for m in self.model.modules() if type(m).__name__.endswith("Experts")
                          and hasattr(m, "gate_up_proj")), None)
            given_router = next((m for m in self.model.modules() if type(m).__name__.endswith("TopKRouter")), None)
            if given is None or given_router is None:
                return Unavailable(f"{type(self.model).__name__} has no sparse MoE block (top-k router and experts)")

        def moe(x, w13, w2, router_logits, topk, *, renormalize=True):
            experts, router = given, given_router
            e, two_i, h = w13.shape
            if experts is None:
                cfg = MoeConfig(hidden_size=h, intermediate_size=two_i, moe_intermediate_size=two_i // 2,
                                num_experts=e, num_experts_per_tok=topk, num_hidden_layers=1, norm_topk_prob=True,
                                num_attention_heads=1, num_key_value_heads=1, head_dim=32, vocab_size=32)
                model = AutoModelForCausalLM.from_config(cfg, dtype=self.dtype).to(self.device)
                experts, router = model.model.layers[0].mlp.experts, model.model.layers[0].mlp.gate
            eye = torch.eye(e, dtype=router.weight.dtype, device=router.weight.device)
            with torch.no_grad():
                saved = experts.gate_up_proj.data, experts.down_proj.data, router.weight.data
                saved_dims = router.hidden_dim, router.top_k, router.norm_topk_prob
                experts.gate_up_proj.data, experts.down_proj.data, router.weight.data = w13, w2, eye
                router.hidden_dim, router.top_k, router.norm_topk_prob = e, topk, renormalize
                try:
                    _, weights, ids = router(router_logits)  # the identity gate hands the logits on exactly
                    return experts(x, ids, weights)
                finally:
                    experts.gate_up_proj.data, experts.down_proj.data, router.weight.data = saved
                    router.hidden_dim, router.top_k, router.norm_topk_prob = saved_dims

        if given is None:
            try:
                probe_cfg = MoeConfig(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_experts=2,
                                      num_experts_per_tok=1, num_hidden_layers=1, num_attention_heads=1,
                                      num_key_value_heads=1, head_dim=32, vocab_size=32)
                default = f"experts_implementation {AutoModelForCausalLM.from_config(probe_cfg).config._experts_implementation}"
            except Exception as e:  # pragma: no cover - another transformers layout
                return Unavailable(f"cannot build a {prefix} model here ({e})")
        else:
            default = f"experts_implementation {getattr(given.config, '_experts_implementation', None)}"
        owner = type(given).__name__ if given is not None else f"{prefix}Experts"
        router_name = type(given_router).__name__ if given_router is not None else f"{prefix}TopKRouter"
        return RegionImpl(moe, f"transformers {router_name}.forward (identity gate), then {owner}.forward ({default})",
                          [f"model family {self.family if self.family in FAMILIES and FAMILIES[self.family].moe else 'qwen3_moe'}, "
                           f"{torch.get_num_threads()} threads"])

    def shared_expert(self) -> RegionImpl | Unavailable:
        """Qwen2-MoE's shared expert as HF runs it: a ``Qwen2MoeDecoderLayer`` (built as
        ``from_config`` builds it) run on the residual, its attention returning zeros and its
        post-attention norm handing the probe's ``x`` to the sparse MoE block, whose routed experts
        return the probe's routed output; so the block's own forward (shared expert, sigmoid gate,
        sum) and the layer's residual add are HF's code. With a given model: its first decoder layer
        whose MLP has a shared expert."""
        try:
            from transformers import Qwen2MoeConfig
            from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeDecoderLayer
        except ImportError as e:  # pragma: no cover - a transformers without Qwen2-MoE
            return Unavailable(f"transformers has no Qwen2-MoE here ({e})")
        given = None
        if self.model is not None:
            given = next((m for m in find_decoder_layers(self.model) if hasattr(m.mlp, "shared_expert")), None)
            if given is None:
                return Unavailable(f"{type(self.model).__name__} has no sparse MoE block with a shared expert")
        layers: dict[tuple[int, int], Any] = {}

        def layer_for(h: int, i: int):
            if given is not None:
                return given
            if (h, i) not in layers:
                cfg = Qwen2MoeConfig(hidden_size=h, intermediate_size=i, moe_intermediate_size=32, num_experts=2,
                                     num_experts_per_tok=1, shared_expert_intermediate_size=i, num_hidden_layers=1,
                                     num_attention_heads=1, num_key_value_heads=1, vocab_size=32)
                cfg._attn_implementation = "eager"
                layers[h, i] = Qwen2MoeDecoderLayer(cfg, layer_idx=0).to(device=self.device, dtype=self.dtype)
            return layers[h, i]

        def shared_expert(x, w_gate_up, w_down, w_gate, routed, residual):
            t, h = x.shape
            i = w_down.shape[1]
            layer = layer_for(h, i)
            block = layer.mlp
            se = block.shared_expert
            gate_w, up_w = w_gate_up[:i], w_gate_up[i:]
            with torch.no_grad():
                saved = [(m, m.weight.data) for m in (se.gate_proj, se.up_proj, se.down_proj, block.shared_expert_gate)]
                for (m, _), w in zip(saved, (gate_w, up_w, w_down, w_gate)):
                    m.weight.data = w.contiguous()
                pos = torch.arange(t, device=x.device).unsqueeze(0)
                try:
                    with _swap(layer, self_attn=_AttnReturns(torch.zeros_like(residual).unsqueeze(0)),
                               post_attention_layernorm=_Returns(x.unsqueeze(0))), _swap(block, experts=_Returns(routed)):
                        out = layer(residual.unsqueeze(0), attention_mask=None, position_ids=pos,
                                    position_embeddings=(torch.ones(1, t, 2, dtype=x.dtype, device=x.device),) * 2)
                finally:
                    for m, w in saved:
                        m.weight.data = w
            out = out[0] if isinstance(out, tuple) else out
            return out[0]

        return RegionImpl(shared_expert,
                          "transformers Qwen2MoeDecoderLayer.forward: Qwen2MoeSparseMoeBlock.forward (its shared expert "
                          "and shared_expert_gate; routed experts standing in with the probe's output), then the "
                          "layer's residual add", [f"model family qwen2_moe, {torch.get_num_threads()} threads"])

    # -- building the family's modules for a probe shape ---------------------------------------
    def _parts(self, hidden: int, heads: int = 1, kv: int = 1, head_dim: int = 64, inter: int = 64,
               base: float = 10000.0, eps: float = 1e-6):
        if self.model is not None:
            return self.layer, self.rotary, self.config
        C, Layer, Rotary = family_classes(self.family)
        cfg = C(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv,
                head_dim=head_dim, num_hidden_layers=1, vocab_size=32, rms_norm_eps=eps,
                rope_parameters={"rope_type": "default", "rope_theta": base}, max_position_embeddings=1 << 17,
                # an MoE family's layer with a dense MLP: the swiglu region (its experts are probed by moe())
                **({"mlp_only_layers": [0]} if FAMILIES[self.family].moe else {}))
        cfg._attn_implementation = "eager"
        layer = Layer(cfg, layer_idx=0).to(device=self.device, dtype=self.dtype)
        rot = Rotary(cfg).to(self.device)
        return layer, rot, cfg

    def regions(self) -> dict[str, RegionImpl | Unavailable]:
        dev = self.device

        def rmsnorm(x, weight, eps):
            layer, _, _ = self._parts(x.shape[-1], eps=eps)
            norm = layer.input_layernorm
            with torch.no_grad(), _weight(norm, weight):
                return norm(x.unsqueeze(0))[0]

        def add_rmsnorm(x, residual, weight, eps):
            layer, rot, cfg = self._parts(x.shape[-1], eps=eps)
            rec = _Record()
            t = x.shape[0]
            pos = torch.arange(t, device=dev).unsqueeze(0)
            with torch.no_grad(), _weight(layer.post_attention_layernorm, weight), \
                    _swap(layer, self_attn=_AttnReturns(x.unsqueeze(0)), mlp=rec):
                out = layer(residual.unsqueeze(0), attention_mask=None, position_ids=pos,
                            position_embeddings=rot(residual.unsqueeze(0), pos))
            out = out[0] if isinstance(out, tuple) else out
            return rec.seen[0], out[0]

        def swiglu(gate, up):
            layer, _, _ = self._parts(64, inter=gate.shape[-1])
            mlp = layer.mlp
            ident = _Identity()
            dummy = torch.zeros(1, gate.shape[0], 1, dtype=gate.dtype, device=dev)
            with torch.no_grad(), _swap(mlp, gate_proj=_Returns(gate.unsqueeze(0)), up_proj=_Returns(up.unsqueeze(0)),
                                        down_proj=ident):
                return mlp(dummy)[0]

        def rope(positions, q, k, *, base, style):
            if style != "neox":
                raise Unavailable(f"HF {self.family} applies RoPE in the neox (rotate_half) layout only")
            t, hq, d = q.shape
            hk = k.shape[1]
            layer, rot, cfg = self._parts(hq * d, heads=hq, kv=hk, head_dim=d, base=base)
            attn = layer.self_attn
            parts = dict(q_proj=_Returns(q.reshape(1, t, hq * d)), k_proj=_Returns(k.reshape(1, t, hk * d)),
                         v_proj=_Returns(k.reshape(1, t, hk * d)), o_proj=_Identity())
            if hasattr(attn, "q_norm"):
                parts.update(q_norm=_Identity(), k_norm=_Identity())
            old_impl = attn.config._attn_implementation
            pos = positions.unsqueeze(0)
            try:
                attn.config._attn_implementation = CAPTURE
                with torch.no_grad(), _swap(attn, **parts):
                    dummy = torch.zeros(1, t, hq * d, dtype=q.dtype, device=dev)
                    attn(hidden_states=dummy, position_embeddings=rot(dummy, pos), attention_mask=None)
            finally:
                attn.config._attn_implementation = old_impl
            qo, ko = attn.__dict__.pop("_engineprofiles_qk")
            return qo[0].transpose(0, 1), ko[0].transpose(0, 1)

        what = f"patched model ({self.label})" if self.label else (f"{type(self.model).__name__}" if self.model is not None else f"{self.family} modules")
        return {
            "rope": RegionImpl(rope, f"transformers {what}: rotary embedding + attention's apply_rotary_pos_emb"),
            "swiglu": RegionImpl(swiglu, f"transformers {what}: MLP act_fn(gate) * up"),
            "add_rmsnorm": RegionImpl(add_rmsnorm, f"transformers {what}: decoder layer residual add + post-attention norm"),
            "rmsnorm": RegionImpl(rmsnorm, f"transformers {what}: first layer's input norm"),
        }


class _Identity(torch.nn.Module):
    def forward(self, x):
        return x


class _Returns(torch.nn.Module):
    """Stands in for a module: returns the given tensor whatever it is called with."""

    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.value = value

    def forward(self, *args, **kwargs):
        return self.value


class _AttnReturns(torch.nn.Module):
    """Stands in for self-attention: returns the probe's x as the attention output."""

    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.value = value

    def forward(self, hidden_states=None, **kwargs):
        return self.value, None


def _attention(self: "TransformersAdapter") -> RegionImpl | Unavailable:
    """The attention function the model's config selects (``sdpa`` for a model built or loaded
    with defaults), called as HF's attention modules call it: [1, H, T, D] tensors, no mask
    for a whole sequence (is_causal) or a single query, a boolean (sdpa) or additive (eager)
    causal mask for a chunk of queries at the end of a longer sequence."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ...regions import causal_mask

    name = (getattr(self.config, "_attn_implementation", None) if self.model is not None else None) or "sdpa"
    if name == "eager":
        _, Layer, _ = family_classes(self.family if self.family in FAMILIES else "qwen2")
        fn = __import__(Layer.__module__, fromlist=["eager_attention_forward"]).eager_attention_forward
    elif name in ALL_ATTENTION_FUNCTIONS:
        fn = ALL_ATTENTION_FUNCTIONS[name]
    else:
        return Unavailable(f"attention implementation {name!r} is not one transformers knows")

    class _Module(torch.nn.Module):
        is_causal = True

        def __init__(self, groups: int):
            super().__init__()
            self.num_key_value_groups = groups
            self.training = False

    def attention(q, k, v, *, scale):
        tq, hq, d = q.shape
        tk, hk, _ = k.shape
        mask = None
        if 1 < tq < tk:
            allowed = causal_mask(tq, tk)[None, None]
            mask = allowed if name != "eager" else torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(
                ~allowed, torch.finfo(q.dtype).min)
        hf = lambda t: t.transpose(0, 1).unsqueeze(0).to(self.device)  # noqa: E731
        with torch.no_grad():
            out, _ = fn(_Module(hq // hk), hf(q), hf(k), hf(v), mask, dropout=0.0, scaling=scale)
        return out[0].to("cpu")  # [T, H, D]

    return RegionImpl(attention, f"transformers {name} attention ({getattr(fn, '__qualname__', name)})")
