"""The references compute the lattice: known points reproduce HF transformers' eager modules bit
for bit, other points differ from them, and canonicalization only merges points that can never
differ."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engineprofiles.errors import PointError
from engineprofiles.regions import (
    ADD_SPEC, PLAIN_SPEC, REGIONS, ROPE_SPEC, SWIGLU_SPEC, add_rmsnorm_ref, rmsnorm_ref, rope_cos_sin, rope_ref,
    swiglu_ref,
)
from engineprofiles.regions.rope import fma

import transformers  # noqa: E402  a test dependency (pip install -e .[test]): missing, these tests fail, never skip
from transformers import LlamaConfig, Qwen2Config, Qwen3Config  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.qwen2 import modeling_qwen2  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402

FAMILIES = {
    "qwen2": (Qwen2Config, modeling_qwen2, "Qwen2"),
    "qwen3": (Qwen3Config, modeling_qwen3, "Qwen3"),
    "llama": (LlamaConfig, modeling_llama, "Llama"),
}
DTYPES = [torch.bfloat16, torch.float16]

# The points that describe HF transformers' eager modules (read off their code: every op on
# activation-dtype tensors rounds its result; cos/sin are cast to the activation dtype).
HF_ROPE = ROPE_SPEC.point(cos_sin="rounded", products="rounded")
HF_SWIGLU = SWIGLU_SPEC.point(silu="rounded", silu_formula="fused")
HF_RMSNORM = PLAIN_SPEC.point(normalized="rounded", output="rounded", rstd="rsqrt")
HF_ADD_RMSNORM = ADD_SPEC.point(
    variance_input="rounded", normalize_input="rounded", normalized="rounded", residual_out="rounded", rstd="rsqrt"
)


def _cfg(family, hidden=256, inter=704, heads=4, kv=2, head_dim=64):
    cls, mod, prefix = FAMILIES[family]
    kw = dict(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv,
              rms_norm_eps=1e-6, num_hidden_layers=1, vocab_size=64)
    if family == "qwen3" or family == "llama":
        kw["head_dim"] = head_dim
    return cls(**kw), mod, prefix


def _differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a.float() != b.float()).any())


def _site_differs(spec, p, q) -> bool:
    return spec.site_part(p) != spec.site_part(q)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 256), (37, 896), (129, 151)])
def test_rmsnorm_reference_reproduces_hf_rmsnorm_at_its_point_only(family, dtype, tokens, hidden):
    _, mod, prefix = FAMILIES[family]
    g = torch.Generator().manual_seed(tokens * 1000 + hidden)
    norm = getattr(mod, f"{prefix}RMSNorm")(hidden, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=g))
    x = (torch.randn(tokens, hidden, generator=g) * 3).to(dtype)
    resid = (torch.randn(tokens, hidden, generator=g) * 20).to(dtype)
    with torch.no_grad():
        hf_plain = norm(x)
        summed = resid + x  # the decoder layer's residual add, in the activation dtype
        hf_add = norm(summed)
    assert torch.equal(rmsnorm_ref(x, norm.weight, 1e-6, HF_RMSNORM), hf_plain)
    out, res = add_rmsnorm_ref(x, resid, norm.weight, 1e-6, HF_ADD_RMSNORM)
    assert torch.equal(out, hf_add) and torch.equal(res, summed)
    if tokens * hidden < 5000:
        return  # too few elements to expect every other point to show a difference
    for p in PLAIN_SPEC.all_points():
        if _site_differs(PLAIN_SPEC, p, HF_RMSNORM):
            assert _differs(rmsnorm_ref(x, norm.weight, 1e-6, p), hf_plain), p
    for p in ADD_SPEC.all_points():
        if _site_differs(ADD_SPEC, p, HF_ADD_RMSNORM):
            o, r = add_rmsnorm_ref(x, resid, norm.weight, 1e-6, p)
            assert _differs(o, hf_add) or _differs(r, summed), p


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 704), (3, 17, 704), (64, 4864)])
def test_swiglu_reference_reproduces_hf_mlp_activation_at_its_point_only(family, dtype, shape):
    cfg, mod, prefix = _cfg(family)
    mlp = getattr(mod, f"{prefix}MLP")(cfg)
    g = torch.Generator().manual_seed(sum(shape))
    gate = (torch.randn(*shape, generator=g) * 2).to(dtype)
    up = torch.randn(*shape, generator=g).to(dtype)
    with torch.no_grad():
        hf = mlp.act_fn(gate) * up  # the MLP's act_fn(gate_proj(x)) * up_proj(x)
    assert torch.equal(swiglu_ref(gate, up, HF_SWIGLU), hf)
    if gate.numel() < 5000:
        return
    for p in SWIGLU_SPEC.all_points():
        if _site_differs(SWIGLU_SPEC, p, HF_SWIGLU):
            assert _differs(swiglu_ref(gate, up, p), hf), p


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv,head_dim,max_pos", [(1, 4, 2, 64, 10), (19, 14, 2, 64, 40000), (33, 4, 4, 128, 4096)])
def test_rope_reference_reproduces_hf_rotary_at_its_point_only(family, dtype, tokens, heads, kv, head_dim, max_pos):
    cfg, mod, prefix = _cfg(family, hidden=heads * head_dim, heads=heads, kv=kv, head_dim=head_dim)
    rot = getattr(mod, f"{prefix}RotaryEmbedding")(cfg)
    g = torch.Generator().manual_seed(tokens + heads + max_pos)
    pos = torch.randint(0, max_pos, (2, tokens), generator=g)
    q = torch.randn(2, heads, tokens, head_dim, generator=g).to(dtype)
    k = (torch.randn(2, kv, tokens, head_dim, generator=g) * 4).to(dtype)
    cos_hf, sin_hf = rot(q, pos)
    q_hf, k_hf = mod.apply_rotary_pos_emb(q, k, cos_hf, sin_hf)
    theta = cfg.rope_parameters["rope_theta"]
    cos, sin = rope_cos_sin(pos, head_dim, theta)
    # Our layout is [*lead, heads, head_dim]; HF's is [batch, heads, tokens, head_dim].
    q_ref = rope_ref(q.transpose(1, 2), cos, sin, HF_ROPE).transpose(1, 2)
    k_ref = rope_ref(k.transpose(1, 2), cos, sin, HF_ROPE).transpose(1, 2)
    assert torch.equal(q_ref, q_hf) and torch.equal(k_ref, k_hf)
    if q.numel() < 5000:
        return
    for p in ROPE_SPEC.all_points():
        if _site_differs(ROPE_SPEC, p, HF_ROPE):
            assert _differs(rope_ref(q.transpose(1, 2), cos, sin, p).transpose(1, 2), q_hf), p


def test_rope_interleaved_style_rotates_adjacent_pairs():
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]], dtype=torch.bfloat16)
    cos = torch.tensor([[0.0, 1.0]])
    sin = torch.tensor([[1.0, 0.0]])
    p = ROPE_SPEC.point(cos_sin="fp32", products="fp32")
    # interleaved: pair (1, 2) rotated by 90 degrees -> (-2, 1), pair (3, 4) unrotated;
    # neox: pairs (1, 3) rotated -> (-3, 1) and (2, 4) unrotated
    assert rope_ref(x, cos, sin, p, style="interleaved").flatten().tolist() == [-2.0, 1.0, 3.0, 4.0]
    assert rope_ref(x, cos, sin, p, style="neox").flatten().tolist() == [-3.0, 2.0, 1.0, 4.0]


def test_rope_passes_lanes_beyond_the_rotary_dim_through():
    x = torch.randn(5, 2, 8).bfloat16()
    cos, sin = rope_cos_sin(torch.arange(5), 4)
    out = rope_ref(x, cos, sin, ROPE_SPEC.point(cos_sin="fp32", products="fp32"))
    assert torch.equal(out[..., 4:], x[..., 4:])


def test_fma_is_correctly_rounded_including_double_rounding_traps():
    # a*b is exactly an FP32 midpoint, c is tiny: FP64 alone would round the tie to even.
    a = torch.tensor([1.0 + 2**-12], dtype=torch.float32)
    b = torch.tensor([1.0 + 2**-12], dtype=torch.float32)  # a*b = 1 + 2**-11 + 2**-24: a midpoint
    for c, want in ((2.0**-60, 1.0 + 2**-11 + 2**-23), (-(2.0**-60), 1.0 + 2**-11)):
        got = fma(a, b, torch.tensor([c], dtype=torch.float32))
        assert got.item() == want
    g = torch.Generator().manual_seed(3)
    a, b, c = (torch.randn(256, generator=g) * torch.exp2(torch.randint(-30, 30, (256,), generator=g).float()) for _ in range(3))
    got = fma(a, b, c)
    from fractions import Fraction
    for i in range(256):
        t = Fraction(a[i].item()) * Fraction(b[i].item()) + Fraction(c[i].item())
        near = torch.tensor(float(t)).float()
        cands = [torch.nextafter(near, torch.tensor(-float("inf"))), near, torch.nextafter(near, torch.tensor(float("inf")))]
        dist = [abs(Fraction(v.item()) - t) for v in cands]
        best = min(dist)
        winners = [v for v, d in zip(cands, dist) if d == best]
        if len(winners) > 1:  # a tie: the even one
            winners = [v for v in winners if v.view(torch.int32).item() % 2 == 0]
        assert got[i].item() == winners[0].item(), (i, a[i], b[i], c[i])


@pytest.mark.parametrize("spec", list(REGIONS.values()), ids=list(REGIONS))
def test_lattice_enumeration_is_the_product_of_options_up_to_canonicalization(spec):
    every = spec.all_points(canonical=False)
    n = 1
    for c in spec.choices:
        n *= len(c.options)
    assert len(every) == len(set(every)) == n
    canonical = spec.all_points()
    assert set(canonical) == {spec.canonicalize(p) for p in every}
    assert all(spec.is_canonical(p) for p in canonical)


def test_point_construction_rejects_unknown_sites_and_options():
    with pytest.raises(PointError, match="has no site or variant 'cos'"):
        ROPE_SPEC.point(cos="fp32", products="fp32")
    with pytest.raises(PointError, match="must be one of fp32, rounded"):
        ROPE_SPEC.point(cos_sin="bf16", products="fp32")
    with pytest.raises(PointError, match="missing site"):
        ROPE_SPEC.point(cos_sin="fp32")


def _inputs(region, dtype, g):
    if region == "rope":
        x = (torch.randn(9, 3, 64, generator=g) * 2).to(dtype)
        cos, sin = rope_cos_sin(torch.randint(0, 50000, (9,), generator=g), 64)
        return lambda p: (rope_ref(x, cos, sin, p),)
    if region == "swiglu":
        gate, up = (torch.randn(9, 300, generator=g) * 3).to(dtype), torch.randn(9, 300, generator=g).to(dtype)
        return lambda p: (swiglu_ref(gate, up, p),)
    x, r = torch.randn(9, 300, generator=g).to(dtype), (torch.randn(9, 300, generator=g) * 30).to(dtype)
    w = (1 + 0.1 * torch.randn(300, generator=g)).to(dtype)
    if region == "rmsnorm":
        return lambda p: (rmsnorm_ref(x, w, 1e-6, p),)
    return lambda p: add_rmsnorm_ref(x, r, w, 1e-6, p)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(list(REGIONS)), st.sampled_from(DTYPES), st.integers(0, 2**31 - 1), st.data())
def test_canonicalization_only_merges_points_that_compute_the_same_bits(region, dtype, seed, data):
    spec = REGIONS[region]
    p = data.draw(st.sampled_from(spec.all_points(canonical=False)))
    run = _inputs(region, dtype, torch.Generator().manual_seed(seed))
    c = spec.canonicalize(p)
    assert spec.canonicalize(c) == c
    for a, b in zip(run(p), run(c)):
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a, b.view(torch.uint8) if b.dtype != torch.float32 else b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_distinct_canonical_site_choices_are_distinguishable(dtype):
    # The converse of canonicalization: canonical points whose sites differ produce different
    # outputs on ordinary inputs, so a probe can tell them apart.
    for region, spec in REGIONS.items():
        run = _inputs(region, dtype, torch.Generator().manual_seed(7))
        outs = {p: run(p) for p in spec.all_points()}
        for p, q in itertools.combinations(outs, 2):
            if spec.site_part(p) != spec.site_part(q):
                assert any(_differs(a, b) or a.dtype != b.dtype for a, b in zip(outs[p], outs[q])), (p, q)


# -- RoPE's frequencies under rope scaling (rope_type) ---------------------------------------------

LLAMA3 = [  # Llama 3.1's parameters, and a config whose blended band is wider (factor not a power of two)
    dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=8192),
    dict(rope_type="llama3", rope_theta=10000.0, factor=3.0, low_freq_factor=1.5, high_freq_factor=5.0,
         original_max_position_embeddings=512),
]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("params", LLAMA3, ids=["llama3.1", "llama3-wide-band"])
def test_llama3_frequencies_are_hfs_bit_for_bit_with_every_band_present(params, head_dim):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engineprofiles.regions import RopeFrequencies

    cfg = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                      max_position_embeddings=16384, rope_parameters=dict(params))
    hf, scaling = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    f = RopeFrequencies.from_parameters(head_dim, params)
    inv, plain = f.inv_freq(), f.default_inv_freq()
    assert scaling == 1.0 and inv.dtype == torch.float32
    assert torch.equal(inv, hf)
    # the three bands: kept, divided by factor, blended (neither)
    kept, divided = inv == plain, inv == plain / params["factor"]
    assert kept.any() and divided.any() and (~kept & ~divided).any()
    # and the cos/sin follow from them: angle = position * inv_freq in FP32
    pos = torch.arange(0, 40000, 7)
    cos, sin = f.cos_sin(pos)
    angle = pos.float().unsqueeze(-1) * hf
    assert torch.equal(cos, angle.cos()) and torch.equal(sin, angle.sin())
    assert not torch.equal(cos, rope_cos_sin(pos, head_dim, params["rope_theta"])[0])


def test_linear_scaling_scales_the_position_as_engines_do_or_the_frequency_as_hf_does():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engineprofiles.regions import RopeFrequencies

    params = dict(rope_type="linear", rope_theta=1e6, factor=3.0)
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, rope_parameters=dict(params))
    hf_inv, _ = ROPE_INIT_FUNCTIONS["linear"](cfg, "cpu")
    pos = torch.arange(0, 30000, 3)
    engines = RopeFrequencies.from_parameters(64, params)
    hf = RopeFrequencies.from_parameters(64, params, linear_scales="frequency")
    assert torch.equal(hf.inv_freq(), hf_inv)
    (c_e, s_e), (c_h, s_h) = engines.cos_sin(pos), hf.cos_sin(pos)
    angle_e = (pos.float() / 3.0).unsqueeze(-1) * engines.default_inv_freq()
    assert torch.equal(c_e, angle_e.cos()) and torch.equal(s_e, angle_e.sin())
    angle_h = pos.float().unsqueeze(-1) * hf_inv
    assert torch.equal(c_h, angle_h.cos()) and torch.equal(s_h, angle_h.sin())
    assert not torch.equal(c_e, c_h)  # a factor that is not a power of two: the two conventions round apart
    two = dict(params, factor=2.0)  # a power of two: dividing is exact either way
    assert torch.equal(RopeFrequencies.from_parameters(64, two).cos_sin(pos)[0],
                       RopeFrequencies.from_parameters(64, two, linear_scales="frequency").cos_sin(pos)[0])


@pytest.mark.parametrize("params,match", [
    (dict(rope_type="dynamic", factor=2.0), "rope_type 'dynamic' needs the engine whose convention it follows"),
    (dict(rope_type="yarn", factor=4.0), "rope_type 'yarn' needs rope_parameters\\['original_max_position_embeddings'\\]"),
    (dict(rope_type="longrope"), "rope_type 'longrope' is not supported"),
    (dict(rope_type="su"), "rope_type 'su' is not supported .*supported: default, linear, llama3, yarn, dynamic"),
    (dict(rope_type="llama3", factor=8.0), "rope_type 'llama3' needs rope_parameters\\['low_freq_factor'\\]"),
    (dict(rope_type="linear"), "rope_type 'linear' needs rope_parameters\\['factor'\\]"),
])
def test_rope_parameters_it_does_not_reproduce_are_refused_by_name(params, match):
    from engineprofiles.regions import RopeFrequencies, RopeParametersError

    with pytest.raises(RopeParametersError, match=match):
        RopeFrequencies.from_parameters(64, dict(params, rope_theta=1e4))


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "mistral", "qwen3_moe", "qwen2_moe"])
def test_the_transformers_probe_builds_each_familys_own_layers(family):
    from engineprofiles.names import FAMILY_NAMES
    from engineprofiles.probe.adapters.transformers import family_classes

    assert family in FAMILY_NAMES
    config, layer, rotary = family_classes(family)
    for cls in (config, layer, rotary):
        assert cls.__module__.split(".")[-1] in (f"modeling_{family}", f"configuration_{family}"), cls


def test_the_transformers_probe_of_qwen3_moe_probes_a_dense_layer_and_the_experts():
    """Qwen3-MoE's layers round as HF's other families do (the shipped transformers profile), and its
    experts as the shipped profile's moe entry says (probed through Qwen3MoeExperts)."""
    from engineprofiles.probe.adapters.transformers import TransformersAdapter
    from engineprofiles.probe.harness import run_probe
    from engineprofiles.store import get_profile

    from engineprofiles.regions import MOE_SPEC

    prof, _ = run_probe(TransformersAdapter(family="qwen3_moe"), quick=True, regions=["swiglu", "moe"])
    shipped = get_profile("transformers-5.19.0-cpu-eager-bfloat16")
    assert prof.point("swiglu") == shipped.point("swiglu") and prof.entry("swiglu").evidence.match_rate == 1.0
    got, want, ev = prof.point("moe"), shipped.point("moe"), prof.moe.evidence
    assert MOE_SPEC.site_part(got) == MOE_SPEC.site_part(want) and ev.match_rate == 1.0
    # the quick probe's two cases may not tell the GEMM order apart; then it says so
    label = " ".join(f"{k}={v}" for k, v in MOE_SPEC.variant_part(want).items())
    assert got == want or label in ev.indistinguishable, (got, ev.indistinguishable)


def test_the_transformers_probe_of_qwen2_moe_probes_its_own_experts_and_shared_expert():
    """Qwen2-MoE's experts through its own classes (Qwen2MoeTopKRouter, Qwen2MoeExperts), with and without
    renormalization, and its shared expert: the shipped transformers profile's points, at 100%."""
    from engineprofiles.probe.adapters.transformers import TransformersAdapter
    from engineprofiles.probe.harness import run_probe
    from engineprofiles.regions import MOE_SPEC
    from engineprofiles.store import get_profile

    prof, _ = run_probe(TransformersAdapter(family="qwen2_moe"), regions=["moe", "shared_expert"])
    shipped = get_profile("transformers-5.19.0-cpu-eager-bfloat16")
    assert "Qwen2MoeTopKRouter" in prof.moe.evidence.path and "Qwen2MoeExperts" in prof.moe.evidence.path
    assert any("renormalize=False" in s for s in prof.moe.evidence.shapes)
    assert MOE_SPEC.site_part(prof.point("moe")) == MOE_SPEC.site_part(shipped.point("moe"))
    assert prof.moe.evidence.match_rate == 1.0
    assert prof.point("shared_expert") == shipped.point("shared_expert")
    assert prof.shared_expert.evidence.match_rate == 1.0 and "Qwen2MoeDecoderLayer" in prof.shared_expert.evidence.path


def test_dynamic_rope_is_each_engines_fixed_ntk_base():
    """vLLM: theta unless max_trained_positions is given; SGLang: a base scaled over max_position * factor;
    both a default RoPE with that base (checked against the engines' own caches in
    tests/engines/test_rope_scaling_engine.py). HF ("transformers"): theta within the original context,
    positions beyond it refused (HF rescales there)."""
    from engineprofiles.regions import RopeFrequencies, RopeParametersError

    p = dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)
    v = RopeFrequencies.from_parameters(64, p, dynamic="vllm", max_position_embeddings=4096)
    assert v.rope_type == "default" and v.theta == 10000.0
    t = RopeFrequencies.from_parameters(64, dict(p, max_trained_positions=2048), dynamic="vllm",
                                        max_position_embeddings=4096)
    assert t.theta == 10000.0 * (2.0 * 4096 / 2048 - 1.0) ** (64 / 62)
    sg = RopeFrequencies.from_parameters(64, p, dynamic="sglang", max_position_embeddings=4096)
    assert sg.theta == 10000.0 * (2.0 * 8192.0 / 4096 - 1.0) ** (64 / 62)
    pos = torch.arange(0, 3000, 11)
    assert not torch.equal(v.cos_sin(pos)[0], sg.cos_sin(pos)[0])
    with pytest.raises(RopeParametersError, match="max_position_embeddings"):
        RopeFrequencies.from_parameters(64, p, dynamic="vllm")
    hf = RopeFrequencies.from_parameters(64, p, dynamic="transformers", max_position_embeddings=4096)
    assert torch.equal(hf.cos_sin(pos)[0], RopeFrequencies(64, 10000.0).cos_sin(pos)[0])
    with pytest.raises(RopeParametersError, match="position 4096 is beyond"):
        hf.cos_sin(torch.tensor([5, 4096]))
