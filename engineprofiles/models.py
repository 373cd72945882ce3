"""Tiny HF transformers models of the supported families, built locally and deterministically.

Tests, closed-loop probes, benchmarks and end-to-end checks need a real model of each family
without downloading one. :func:`tiny_model` builds it from a config alone, with weights drawn from
a seeded generator at realistic scales (norm weights around 1 +- 0.1, projections and embeddings
N(0, 0.02), Qwen2's attention biases and Qwen2-MoE's shared-expert gate N(0, 0.02)), so the same seed gives the same bits on every
machine. torch and transformers are imported when a model is built, not when this module is.

    >>> model = tiny_model("qwen3", seed=1)              # 2 layers, hidden 256, vocab 256, BF16
    >>> wide = tiny_model("qwen2", **QWEN25_05B_WIDTHS)   # Qwen2.5-0.5B's widths, 2 layers
    >>> scaled = tiny_model("llama", rope_scaling="yarn")  # one of ROPE_SCALINGS (CLI --rope-scaling)
"""

from __future__ import annotations

from typing import Any

from .families import FAMILIES
from .names import ROPE_SCALING_NAMES, check_family_name, check_rope_scaling_name

# Defaults: small, but with GQA, head_dim 64, a hidden size that is not a single head, and
# positions well beyond 32k allowed.
DEFAULTS: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    rms_norm_eps=1e-6,
    max_position_embeddings=40960,
)

# RoPE scalings (rope_parameters beside the family's rope_theta; ``tiny_model(..., rope_scaling=NAME)``,
# CLI --rope-scaling): Llama 3.1's llama3 parameters, and linear with a factor that is not a power of
# two, where the engines (which scale the position) and HF (which scales the frequency) round apart.
ROPE_SCALINGS: dict[str, dict[str, Any]] = {
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192),
    "linear": dict(rope_type="linear", factor=3.0),
    # YaRN with factor 4 over an original context of a quarter of the tiny models' 40960 positions
    # (HF checks factor == max_position_embeddings / original), the default betas and attention factor.
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=10240),
    # dynamic (NTK) with factor 2: a fixed base the engines compute each their own way (vLLM: the plain
    # base unless max_trained_positions is given; SGLang: a scaled one)
    "dynamic": dict(rope_type="dynamic", factor=2.0),
}
assert tuple(ROPE_SCALINGS) == ROPE_SCALING_NAMES

# Qwen2.5-0.5B's widths (its real config), for benchmarks.
QWEN25_05B_WIDTHS: dict[str, Any] = dict(
    hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
    vocab_size=256,
)


def _config_class(family: str):
    import transformers

    return getattr(transformers, FAMILIES[check_family_name(family)].config)


def tiny_config(family: str = "qwen2", *, attn_implementation: str = "sdpa", rope_scaling: str | None = None,
                **overrides: Any):
    """The config of a tiny model of ``family``; ``rope_scaling``: one of :data:`ROPE_SCALINGS` (None:
    default RoPE); ``overrides`` replace any config field."""
    C = _config_class(family)
    kw = dict(DEFAULTS)
    fam = FAMILIES[family]
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": fam.rope_theta}
    if rope_scaling is not None:
        kw["rope_parameters"] = {**ROPE_SCALINGS[check_rope_scaling_name(rope_scaling)],
                                 "rope_theta": fam.rope_theta}
    kw.update(tie_word_embeddings=False, hidden_act="silu")
    kw.update(fam.tiny_fields)
    kw.update(overrides)
    cfg = C(**kw)
    cfg._attn_implementation = attn_implementation
    return cfg


def init_weights(model: Any, seed: int = 0) -> Any:
    """Fill every parameter of ``model`` from a generator seeded with ``seed``, in name order:
    norm weights 1 + 0.1 N(0, 1), everything else 0.02 N(0, 1). Returns the model."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            p.copy_((1.0 + 0.1 * r) if name.endswith("norm.weight") else 0.02 * r)  # rounded to p's dtype (RNE)
    return model


def tiny_model(
    family: str = "qwen2",
    *,
    seed: int = 0,
    dtype: Any = "bfloat16",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
    rope_scaling: str | None = None,
    **overrides: Any,
) -> Any:
    """A causal LM of ``family`` (qwen2, qwen3, llama, mistral, qwen3_moe, qwen2_moe) with 2 decoder layers by default, its
    weights drawn from ``seed`` (see :func:`init_weights`), in ``dtype``, in eval mode.

    ``rope_scaling``: a RoPE scaling of :data:`ROPE_SCALINGS` (None: default RoPE); ``overrides``
    replace config fields (``hidden_size``, ``num_hidden_layers``, ...)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family, attn_implementation=attn_implementation, rope_scaling=rope_scaling, **overrides)
    dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    # Built in ``dtype`` (not cast afterwards: ``.to(dtype)`` would also round the rotary
    # embedding's FP32 inv_freq buffer, which HF keeps in FP32 when it loads a checkpoint).
    model = AutoModelForCausalLM.from_config(cfg, dtype=dt)
    init_weights(model, seed)
    model = model.to(device=device)
    model.eval()
    return model


def tiny_inputs(model: Any, tokens: int = 32, batch: int = 1, seed: int = 0) -> Any:
    """Token ids [batch, tokens] for ``model``, drawn from ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens), generator=g)
    return ids.to(next(model.parameters()).device)
