"""The model families: one declarative record per family, read by every layer.

A :class:`Family` names the transformers module, class prefix and config class of a decoder family,
the facts in which families differ (Qwen3's q/k norms, Mistral's sliding window in the config, sparse
MoE blocks, a shared expert) and its tiny model's config (engineprofiles.models). ``classes()`` finds the
classes on the installed transformers (imported then, not when this module is). The CLI's family
names, the tiny models, the transformers probe and the emulator's checks of a live model
(emulator.patching.families) all read :data:`FAMILIES`: adding a family with the same layer structure
is one more entry here (:func:`register`). A family with sparse MoE blocks (``moe=True``: Qwen3-MoE)
has, in each decoder layer, either the family's dense MLP or its sparse MoE block (a router and the
experts, whose SwiGLU expert MLPs and weighted combine the profile's ``moe`` entry describes); in
Qwen2-MoE (``shared_expert=True``) the block also has a gated shared expert, whose sum with the routed
output the profile's ``shared_expert`` entry describes.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Family:
    name: str
    models: str  # the HF model types it covers, for messages
    module: str
    prefix: str
    qk_norm: bool
    # Where the attention reads its sliding window: its own ``sliding_window`` attribute (Qwen2, Qwen3;
    # None on Llama), or the config (Mistral's attention passes ``config.sliding_window`` to HF's
    # attention function, and its model builds the windowed mask from it).
    window_in_config: bool = False
    # Sparse MoE blocks (``{prefix}SparseMoeBlock``: a ``gate`` router ``{prefix}TopKRouter`` and the
    # ``experts`` ``{prefix}Experts``) in the layers that are not dense (config.mlp_only_layers,
    # decoder_sparse_step); they compute at the profile's ``moe`` point.
    moe: bool = False
    # The sparse blocks also have a shared expert (Qwen2-MoE: ``shared_expert``, the family's dense MLP
    # class, and ``shared_expert_gate``, a Linear hidden -> 1), computed at the profile's
    # ``shared_expert`` point and added to the routed experts' output.
    shared_expert: bool = False
    # The tiny model of the family (engineprofiles.models): its config class in transformers, its RoPE
    # base and the config fields it sets beyond models.DEFAULTS.
    config: str = ""
    rope_theta: float = 1000000.0
    tiny_fields: dict[str, Any] = field(default_factory=dict)

    def sliding_window(self, attention: Any) -> Any:
        """The sliding window the family's attention module uses (None: full causal attention)."""
        if self.window_in_config:
            return getattr(attention.config, "sliding_window", None)
        return getattr(attention, "sliding_window", None)

    def classes(self) -> dict[str, Any]:
        m = importlib.import_module(self.module)
        p = self.prefix
        return dict(
            model=getattr(m, f"{p}Model"), layer=getattr(m, f"{p}DecoderLayer"), attention=getattr(m, f"{p}Attention"),
            mlp=getattr(m, f"{p}MLP"), norm=getattr(m, f"{p}RMSNorm"), rotary=getattr(m, f"{p}RotaryEmbedding"),
            eager_attention=m.eager_attention_forward, replaced=self.replaced(m),
            **({"sparse": getattr(m, f"{p}SparseMoeBlock"), "experts": getattr(m, f"{p}Experts"),
                "router": getattr(m, f"{p}TopKRouter")} if self.moe else {}),
        )

    def replaced(self, m: Any) -> list[tuple[str, str]]:
        """(name, replacement's module) of each region class or function of the family's modeling module
        that another library replaced at module level, e.g. Liger-Kernel's ``apply_liger_kernel_to_qwen2()``
        (``Qwen2RMSNorm = LigerRMSNorm``, ``Qwen2MLP = LigerSwiGLUMLP``, ``apply_rotary_pos_emb = ...``)."""
        p = self.prefix
        names = (f"{p}RMSNorm", f"{p}MLP", "apply_rotary_pos_emb", f"{p}DecoderLayer", f"{p}Attention",
                 f"{p}RotaryEmbedding", f"{p}Model", "eager_attention_forward")
        if self.moe:
            names += (f"{p}SparseMoeBlock", f"{p}Experts", f"{p}TopKRouter")
        out = []
        for n in names:
            obj = getattr(m, n, None)
            where = getattr(obj, "__module__", None)
            if obj is not None and where != m.__name__ and not (where or "").startswith("transformers."):
                out.append((n, f"{where}.{getattr(obj, '__qualname__', n)}"))
        return out


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add ``family`` (or replace the record of that name); every layer sees it from then on."""
    FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    FAMILIES.pop(name, None)


def families_text() -> str:
    return ", ".join(f"{f.name} ({f.models}: {f.prefix}Model)" for f in FAMILIES.values())


def moe_families() -> tuple[str, ...]:
    return tuple(n for n, f in FAMILIES.items() if f.moe)


_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[])
# Tiny models' fields beyond models.DEFAULTS: Mistral's config defaults to a 4096-token sliding window
# (Mistral-7B-v0.1); later Mistral checkpoints have none, and the tiny model neither. Qwen3-MoE: every
# layer a sparse MoE block of 8 experts, 2 per token (Qwen3-30B-A3B has 128 and 8), expert width 128
# (vLLM's CPU fused-MoE kernel needs multiples of 32), top-k weights renormalized. Qwen2-MoE: the same
# experts, not renormalized (Qwen2-MoE's default, as Qwen1.5-MoE-A2.7B), beside a shared expert of width
# 256 and its sigmoid gate (shared_expert_gate); q/k/v biases (its default).
for _f in (
    Family("qwen2", "Qwen2, Qwen2.5", "transformers.models.qwen2.modeling_qwen2", "Qwen2", qk_norm=False,
           config="Qwen2Config"),
    Family("qwen3", "Qwen3", "transformers.models.qwen3.modeling_qwen3", "Qwen3", qk_norm=True, config="Qwen3Config"),
    Family("llama", "Llama", "transformers.models.llama.modeling_llama", "Llama", qk_norm=False, config="LlamaConfig",
           rope_theta=500000.0),
    Family("mistral", "Mistral", "transformers.models.mistral.modeling_mistral", "Mistral", qk_norm=False,
           window_in_config=True, config="MistralConfig", tiny_fields=dict(sliding_window=None)),
    Family("qwen3_moe", "Qwen3-MoE", "transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3Moe", qk_norm=True,
           moe=True, config="Qwen3MoeConfig", tiny_fields=dict(_MOE, norm_topk_prob=True)),
    Family("qwen2_moe", "Qwen2-MoE, Qwen1.5-MoE", "transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2Moe",
           qk_norm=False, moe=True, shared_expert=True, config="Qwen2MoeConfig",
           tiny_fields=dict(_MOE, norm_topk_prob=False, shared_expert_intermediate_size=256, qkv_bias=True,
                            use_sliding_window=False)),
):
    register(_f)
