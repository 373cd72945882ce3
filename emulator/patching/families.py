"""What a model family is, to apply_profile: the checks of a live model.

The families themselves are the bottom layer's table (engineprofiles.families.FAMILIES: module, class
prefix and the facts in which families differ). ``check_decoder`` checks that a live model is made of
exactly the family's modules, with the RoPE and activation the regions model, before anything is
patched.

:data:`NATIVE` is the lattice point each region of HF's own modules computes (eager, any device),
checked against the probe of the installed transformers by tests/emulator/test_patching.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engineprofiles.engines import ENGINES, RopeConventions
from engineprofiles.families import FAMILIES, Family, families_text  # noqa: F401  (the family table)
from engineprofiles.regions import (
    ADD_SPEC,
    PLAIN_SPEC,
    ROPE_SPEC,
    ROUNDED,
    SWIGLU_SPEC,
    Point,
    RopeFrequencies,
    RopeParametersError,
)

from ..errors import UnsupportedModel

# The lattice point each region's HF module computes (eager, any device): cos/sin cast to the
# activation dtype and each product rounded (apply_rotary_pos_emb in BF16); act_fn(gate) rounded
# before it multiplies up; the residual add in BF16 then a norm that rounds x*rstd before the
# weight multiply. tests/emulator/test_patching.py checks these against the probe of the
# installed transformers.
NATIVE: dict[str, Point] = {
    "rope": ROPE_SPEC.point(cos_sin=ROUNDED, products=ROUNDED, fma="none"),
    "swiglu": SWIGLU_SPEC.point(silu=ROUNDED, silu_formula="fused"),
    "add_rmsnorm": ADD_SPEC.point(
        variance_input=ROUNDED, normalize_input=ROUNDED, normalized=ROUNDED, residual_out=ROUNDED, rstd="rsqrt"
    ),
    "rmsnorm": PLAIN_SPEC.point(normalized=ROUNDED, output=ROUNDED, rstd="rsqrt"),
}


@dataclass
class Decoder:
    path: str
    module: torch.nn.Module
    family: Family
    classes: dict[str, Any]
    rope: RopeFrequencies | None = None  # how the engines compute this model's FP32 cos/sin
    inv_freq_exact: bool = True  # HF's own cos/sin are the engines' (its FP32 inv_freq buffer, no scaled position)
    layers: list[torch.nn.Module] = field(default_factory=list)
    sparse: list[int] = field(default_factory=list)  # the layers whose mlp is a sparse MoE block


def find_decoders(model: torch.nn.Module) -> list[Decoder]:
    found: list[Decoder] = []
    for fam in FAMILIES.values():
        try:
            cls = fam.classes()
        except (ImportError, AttributeError):  # pragma: no cover - a transformers without this family
            continue
        for path, mod in model.named_modules():
            if isinstance(mod, cls["model"]):
                found.append(Decoder(path or "(top level)", mod, fam, cls))
    return found


def _check_module(path: str, mod: Any, cls: Any, what: str) -> None:
    if not isinstance(mod, cls):
        raise UnsupportedModel(
            f"{path} is a {type(mod).__name__}, not the family's {cls.__name__} ({what}); apply_profile patches the "
            "model's own transformers modules: apply it before other kernel patches (e.g. Liger), or not at all"
        )


def _check_sparse(path: str, block: Any, c: dict[str, Any], family: Family) -> None:
    """A sparse MoE block the patch computes itself: the family's router and experts, with the
    layout the ``moe`` entry's reference takes (w13 = [gate; up] per expert, not transposed, no
    bias, every expert local); and its shared expert where the family has one."""
    _check_module(f"{path}.gate", block.gate, c["router"], "MoE router")
    _check_module(f"{path}.experts", block.experts, c["experts"], "MoE experts")
    ex = block.experts
    layout = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
              "_is_expert_parallel": False}
    odd = [f"{k}={getattr(ex, k)!r}" for k, want in layout.items() if getattr(ex, k, want) != want]
    if odd:
        raise UnsupportedModel(
            f"{path}.experts has {', '.join(odd)}; the moe entry's experts are a gated SwiGLU with gate_up_proj "
            "[experts, 2*inter, hidden] ([gate; up], not transposed), no bias, all experts on this rank"
        )
    e, two_i, h = ex.gate_up_proj.shape
    if ex.down_proj.shape != (e, h, two_i // 2) or block.gate.weight.shape != (e, h):
        raise UnsupportedModel(
            f"{path}: expert weights of shapes gate_up_proj {tuple(ex.gate_up_proj.shape)}, down_proj "
            f"{tuple(ex.down_proj.shape)} and router {tuple(block.gate.weight.shape)} do not fit together"
        )
    if family.shared_expert:
        _check_shared(path, block, c, h)


def _check_shared(path: str, block: Any, c: dict[str, Any], h: int) -> None:
    """The shared expert the patch computes itself (the ``shared_expert`` entry's reference): the
    family's MLP with plain bias-free nn.Linear projections, and a bias-free nn.Linear gate hidden -> 1.
    A wrapped projection (a PEFT LoRA layer) is refused: the patch reads the weights, not the module's
    output, so an adapter there would silently not apply."""
    se = getattr(block, "shared_expert", None)
    _check_module(f"{path}.shared_expert", se, c["mlp"], "MoE shared expert")
    gate = getattr(block, "shared_expert_gate", None)
    for name, lin in (("shared_expert.gate_proj", getattr(se, "gate_proj", None)),
                      ("shared_expert.up_proj", getattr(se, "up_proj", None)),
                      ("shared_expert.down_proj", getattr(se, "down_proj", None)), ("shared_expert_gate", gate)):
        if type(lin) is not torch.nn.Linear or lin.bias is not None:
            what = type(lin).__name__ if type(lin) is not torch.nn.Linear else "nn.Linear with a bias"
            raise UnsupportedModel(
                f"{path}.{name} is a {what}; the shared_expert entry's shared expert is computed from plain "
                "bias-free nn.Linear weights (an adapter such as PEFT's LoRA on it would not apply): leave the "
                "shared expert's projections without adapters, or do not apply the profile"
            )
    inter = se.gate_proj.weight.shape[0]
    shapes = {"gate_proj": (se.gate_proj.weight.shape, (inter, h)), "up_proj": (se.up_proj.weight.shape, (inter, h)),
              "down_proj": (se.down_proj.weight.shape, (h, inter)), "gate": (gate.weight.shape, (1, h))}
    odd = [f"{k} {tuple(got)} (want {want})" for k, (got, want) in shapes.items() if tuple(got) != want]
    if odd:
        raise UnsupportedModel(f"{path}: shared expert weights of shapes {', '.join(odd)} do not fit a hidden size "
                               f"of {h}")
    act = getattr(se.config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModel(f"{path}.shared_expert: hidden_act is {act!r}; the shared expert is silu(gate) * up")


def replaced_message(fam: Family, replaced: list[tuple[str, str]]) -> str:
    what = ", ".join(f"{n} (now {w})" for n, w in replaced)
    liger = any(w.startswith("liger_kernel") for _, w in replaced)
    who = "Liger-Kernel's class-level patch (apply_liger_kernel_to_*)" if liger else "another library"
    return (
        f"{fam.module} was patched at module level by {who}: {what}. The profile emulates these regions itself, "
        "so both cannot hold: apply_profile refuses rather than let one silently override the other. Build the model "
        "without that patch (for Liger: apply_liger_kernel_to_<family>(rope=False, rms_norm=False, swiglu=False) keeps "
        "its fused linear cross entropy, which does not touch the regions), or do not apply the profile"
    )


def check_decoder(d: Decoder, engine: str = "") -> None:
    """Check the live decoder ``d`` and fill in what the patch needs. ``engine``: the profile's engine
    name (under linear RoPE scaling the engines scale the position, HF transformers the frequency)."""
    c, m, p = d.classes, d.module, d.path
    if c.get("replaced"):
        raise UnsupportedModel(f"{p}: " + replaced_message(d.family, c["replaced"]))
    meta = next((n for n, t in (*m.named_parameters(), *m.named_buffers()) if t.is_meta), None)
    if meta is not None:
        raise UnsupportedModel(
            f"{p}.{meta} is on the meta device (no data yet); apply_profile reads the model's RoPE frequencies: "
            "materialize the model first (model.to_empty(device=...) and load or initialize its weights), then apply "
            "the profile"
        )
    layers, sparse = _check_layers(d)
    _check_module(f"{p}.norm", m.norm, c["norm"], "final RMSNorm")
    _check_module(f"{p}.rotary_emb", m.rotary_emb, c["rotary"], "rotary embedding")
    cfg = m.config
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModel(f"{p}: hidden_act is {act!r}; the SwiGLU region is silu(gate) * up (hidden_act 'silu')")
    rot = m.rotary_emb
    rope, scaling, params = _rope_of(d, engine, layers[0].self_attn.head_dim)
    d.rope, d.layers, d.sparse = rope, layers, sparse
    # HF's own RoPE computes the profile's engine's cos/sin when its FP32 inv_freq buffer holds their
    # frequencies and the position is not scaled (linear scaling: HF divides the frequencies, vLLM and
    # SGLang the position). ``model.to(torch.bfloat16)`` also rounds that buffer, and HF then rotates
    # by rounded frequencies, which no engine does. Otherwise the model gets the emulator's RoPE
    # (cos/sin computed as that engine does) even where HF's RoPE has the profile's rounding sites.
    scales_position = rope.rope_type == "linear" and rope.linear_scales == "position"
    # (HF's dynamic RoPE rescales its frequencies with the sequence length, the engines' never: not HF's own.)
    d.inv_freq_exact = (not scales_position and scaling == rope.mscale and params.get("rope_type") != "dynamic"
                        and rot.inv_freq.dtype == torch.float32
                        and torch.equal(rot.inv_freq.detach().cpu(), rope.inv_freq()))


def _check_layers(d: Decoder) -> tuple[list[torch.nn.Module], list[int]]:
    """The decoder's layers, each checked to be the family's own modules; the indices of the sparse MoE ones."""
    c, m, p = d.classes, d.module, d.path
    layers = list(m.layers)
    if not layers:
        raise UnsupportedModel(f"{p} has no decoder layers")
    sparse: list[int] = []
    for i, layer in enumerate(layers):
        lp = f"{p}.layers.{i}"
        _check_module(lp, layer, c["layer"], "decoder layer")
        _check_module(f"{lp}.self_attn", layer.self_attn, c["attention"], "attention")
        if d.family.moe and isinstance(layer.mlp, c["sparse"]):
            _check_sparse(f"{lp}.mlp", layer.mlp, c, d.family)
            sparse.append(i)
        elif d.family.moe and not isinstance(layer.mlp, c["mlp"]):
            raise UnsupportedModel(
                f"{lp}.mlp is a {type(layer.mlp).__name__}, not the family's {c['mlp'].__name__} (dense MLP) or "
                f"{c['sparse'].__name__} (sparse MoE block); apply_profile patches the model's own transformers "
                "modules: apply it before other kernel patches (e.g. Liger), or not at all"
            )
        else:
            _check_module(f"{lp}.mlp", layer.mlp, c["mlp"], "MLP")
        for n in ("input_layernorm", "post_attention_layernorm"):
            _check_module(f"{lp}.{n}", getattr(layer, n), c["norm"], "RMSNorm")
        if d.family.qk_norm:
            for n in ("q_norm", "k_norm"):
                _check_module(f"{lp}.self_attn.{n}", getattr(layer.self_attn, n), c["norm"], "q/k RMSNorm")
    return layers, sparse


def _rope_of(d: Decoder, engine: str, head_dim: int) -> tuple[RopeFrequencies, float, dict[str, Any]]:
    """The profile's engine's RoPE frequencies for the decoder's rotary embedding and config, HF's cos/sin
    scaling and the rope_parameters; refused where the rotary embedding does not follow them."""
    m, p, cfg = d.module, d.path, d.module.config
    rot = m.rotary_emb
    scaling = float(getattr(rot, "attention_scaling", 1.0))
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if set(params) & {"full_attention", "sliding_attention"}:  # per-layer-type parameters (not these families)
        raise UnsupportedModel(f"{p}: per-layer-type rope_parameters are not supported")
    params.setdefault("rope_type", getattr(rot, "rope_type", "default"))
    rotary_dim = 2 * rot.inv_freq.numel()
    if rotary_dim != head_dim:
        raise UnsupportedModel(
            f"{p}.rotary_emb rotates {rotary_dim} of {head_dim} lanes; only full-head RoPE is supported"
        )
    try:
        theta = getattr(cfg, "rope_theta", None)
        conv = ENGINES[engine].rope if engine in ENGINES else RopeConventions()
        rope = RopeFrequencies.from_parameters(rotary_dim, params, theta=theta, linear_scales=conv.linear_scales,
                                               attention_factor=conv.attention_factor, dynamic=conv.dynamic,
                                               max_position_embeddings=getattr(cfg, "max_position_embeddings", None))
        hf_scale = rope.mscale if rope.rope_type != "yarn" else RopeFrequencies.from_parameters(
            rotary_dim, params, theta=theta).mscale
    except RopeParametersError as e:
        raise UnsupportedModel(f"{p}.rotary_emb: {e}") from None
    if scaling != hf_scale:  # HF's cos/sin scaling (YaRN's attention factor) as its rope_parameters say
        raise UnsupportedModel(
            f"{p}.rotary_emb: attention_scaling is {scaling}, but its rope_parameters give {hf_scale} (only YaRN "
            "folds a scaling into cos/sin); the model's rotary embedding does not follow its rope_parameters")
    return rope, scaling, params
