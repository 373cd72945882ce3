"""The regions of the rounding model, their sites, lattices and torch references."""

from ..names import check_region_name
from .attention import SPEC as ATTENTION_SPEC
from .attention import attention_fp32, attention_ref, causal_mask
from .base import FP32, PRECISIONS, ROUNDED, Choice, Point, RegionSpec
from .moe import SPEC as MOE_SPEC
from .moe import moe_block_ref, moe_ref, route, sequential_linear
from .rmsnorm import ADD_SPEC, PLAIN_SPEC, add_rmsnorm_ref, rmsnorm_ref
from .shared_expert import SPEC as SHARED_EXPERT_SPEC
from .shared_expert import shared_block_ref, shared_expert_ref
from .rope import SPEC as ROPE_SPEC
from .rope import ROPE_TYPES, STYLES, RopeFrequencies, RopeParametersError, rope_cos_sin, rope_ref
from .swiglu import SPEC as SWIGLU_SPEC
from .swiglu import swiglu_ref

# ATTENTION_SPEC is not among them: attention is recorded beside the regions, for exact mode.
# Profile order: the three regions of the model (RoPE, SwiGLU, residual RMSNorm), the residual
# RMSNorm in both call forms.
REGIONS: dict[str, RegionSpec] = {
    s.name: s for s in (ROPE_SPEC, SWIGLU_SPEC, ADD_SPEC, PLAIN_SPEC)
}


# Recorded beside the regions, each with its own entry in a profile: attention (what exact mode
# consumes), the MoE experts (a sparse MoE block's SwiGLU expert MLPs, GEMMs and combine included)
# and the MoE shared expert (Qwen2-MoE's gated dense expert, and its sum with the routed output).
BESIDE: dict[str, RegionSpec] = {s.name: s for s in (ATTENTION_SPEC, MOE_SPEC, SHARED_EXPERT_SPEC)}


def region(name: str) -> RegionSpec:
    return REGIONS[check_region_name(name)]


__all__ = [
    "FP32", "ROUNDED", "PRECISIONS", "Choice", "Point", "RegionSpec", "REGIONS", "region", "STYLES",
    "ROPE_SPEC", "SWIGLU_SPEC", "ADD_SPEC", "PLAIN_SPEC",
    "ATTENTION_SPEC", "MOE_SPEC", "SHARED_EXPERT_SPEC", "shared_block_ref", "shared_expert_ref", "BESIDE", "moe_ref", "moe_block_ref", "route", "sequential_linear", "attention_ref", "attention_fp32", "causal_mask",
    "rope_ref", "rope_cos_sin", "RopeFrequencies", "RopeParametersError", "ROPE_TYPES", "swiglu_ref", "rmsnorm_ref", "add_rmsnorm_ref",
]
