"""Qwen3-MoE under apply_profile: the sparse MoE blocks' experts compute at the profile's ``moe`` point
(``functional.moe``, bit for bit ``moe_ref``), the router hands on FP32 or rounded weights as that
point says, the backward is the straight-through FP32 gradient, the patch reverts bit for bit, and a
profile without a measured moe entry is refused with the model untouched."""

from __future__ import annotations

import copy

import pytest
import torch
import yaml

import emulator
from emulator import functional as F
from emulator.errors import InputError, ProfileMismatch, RegionUnavailable
from emulator.ops.moe import moe_backward
from engineprofiles.models import init_weights, tiny_inputs, tiny_model
from engineprofiles.regions import MOE_SPEC, SWIGLU_SPEC, moe_block_ref, moe_ref
from engineprofiles.rounding import to_act
from engineprofiles.schema import profile_from_yaml
from engineprofiles.store import get_profile

from .helpers import assert_fp32_close, assert_same_bits, assert_untouched, model_state

TRANSFORMERS_PROFILE = "transformers-5.19.0-cpu-eager-bfloat16"

# The measured moe points (each 100% bitwise on its probe).
MEASURED = {
    "vllm-0.32.0-cpu": MOE_SPEC.point(
        gate_up="fp32", silu="fp32", expert_out="fp32", routing_weight="fp32", weighted="fp32", combine="fp32",
        router="softmax_topk", silu_formula="fused", gemm_order="sequential", combine_order="topk", combine_fma="fma"),
    "vllm-0.32.0-cpu-eager": MOE_SPEC.point(
        gate_up="fp32", silu="fp32", expert_out="fp32", routing_weight="rounded", weighted="fp32", combine="fp32",
        router="softmax_topk", silu_formula="fused", gemm_order="sequential", combine_order="topk", combine_fma="fma"),
    "sglang-0.5.23-cpu": MOE_SPEC.point(
        gate_up="rounded", silu="rounded", expert_out="rounded", routing_weight="fp32", weighted="fp32",
        combine="fp32", silu_formula="fused", gemm_order="library", combine_order="topk", combine_fma="none"),
    "transformers-5.19-cpu": MOE_SPEC.point(
        gate_up="rounded", silu="rounded", expert_out="rounded", routing_weight="rounded", weighted="rounded",
        combine="fp32", silu_formula="fused", gemm_order="library", combine_order="topk", combine_fma="none"),
}
HF_POINT = MEASURED["transformers-5.19-cpu"]


def tiny_moe(seed: int = 1, **overrides):
    """A tiny Qwen3-MoE causal LM in BF16 (hidden 64, 4 experts of width 32, top-2, 2 layers), its
    weights drawn as engineprofiles.models.tiny_model draws them."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
              num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False, hidden_act="silu",
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    kw.update(overrides)
    cfg = Qwen3MoeConfig(**kw)
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    init_weights(model, seed)
    # Routers at 0.02 N(0, 1) give near-uniform softmaxes; spread them so the top-k weights differ.
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.mul_(20)
    return model.eval()


def with_moe(base: str, moe: dict) -> object:
    """Shipped profile ``base`` with its moe entry replaced (``moe``: the entry's YAML mapping)."""
    data = yaml.safe_load(get_profile(base).to_yaml())
    data["moe"] = moe
    return profile_from_yaml(yaml.safe_dump(data), f"<{base} with a moe entry>")


def measured(point) -> dict:
    return {"sites": MOE_SPEC.site_part(point), "variants": MOE_SPEC.variant_part(point),
            "evidence": {"status": "measured", "match_rate": 1.0}}


def router_reference(block, x):
    """The router's FP32 top-k weights and ids, computed here as HF's Qwen3MoeTopKRouter does before
    its cast (softmax in FP32, top-k, renormalised with norm_topk_prob)."""
    logits = torch.nn.functional.linear(x, block.gate.weight)
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, block.gate.top_k, dim=-1)
    if block.gate.norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids


def hidden(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 1.5).to(torch.bfloat16)


# -- forward: the patched block is moe_ref at the profile's point, bit for bit ---------------------


@pytest.mark.parametrize("norm_topk_prob", [False, True], ids=["plain", "renormalised"])
@pytest.mark.parametrize("engine", list(MEASURED))
def test_patched_sparse_block_is_moe_ref_at_the_profiles_point_bitwise(engine, norm_topk_prob):
    point = MEASURED[engine]
    model = tiny_moe(seed=3, norm_topk_prob=norm_topk_prob, mlp_only_layers=[1])
    block = model.model.layers[0].mlp
    x = hidden((2, 9, 64), seed=4)
    x2 = x.reshape(-1, 64)
    w32, ids = router_reference(block, x2)
    ex = block.experts
    with torch.no_grad():
        plain = block(x)
        with emulator.apply_profile(model, with_moe(TRANSFORMERS_PROFILE, measured(point)), skip_native=False) as h:
            assert "moe" in h.emulated and "model.layers.0.mlp" in h.modules
            got = block(x)
        logits = torch.nn.functional.linear(x2, block.gate.weight)
        want = moe_block_ref(x2, ex.gate_up_proj, ex.down_proj, logits, block.gate.top_k, point,
                             renormalize=norm_topk_prob).reshape(x.shape)
        if point["router"] == "softmax_all":  # from HF's router's own FP32 weights and ids, the same
            assert_same_bits(moe_ref(x2, ex.gate_up_proj, ex.down_proj, w32, ids, point).reshape(x.shape), want,
                             "moe_ref from the router's weights")
        # The router's own (rounded) weights are the FP32 ones rounded to nearest even: the routing_weight site.
        _, hf_w, hf_ids = block.gate(x2)
        assert torch.equal(hf_ids, ids)
        assert_same_bits(hf_w, to_act(w32, torch.bfloat16), "router weights")
        assert len(torch.unique(ids)) == 4, "every expert routed to"
        assert_same_bits(got, want, f"{engine}: patched block vs moe_ref")
        # The check can fail: the same inputs at a point with gate_up flipped give other bits.
        flipped = point.replace(gate_up="fp32" if point["gate_up"] == "rounded" else "rounded")
        other = moe_block_ref(x2, ex.gate_up_proj, ex.down_proj, logits, block.gate.top_k, flipped,
                              renormalize=norm_topk_prob).reshape(x.shape)
        assert not torch.equal(other, want), "the flipped point must differ here"
        if point["routing_weight"] == "fp32" and point["router"] == "softmax_all":  # the router's rounded weights differ
            rounded = moe_ref(x2, ex.gate_up_proj, ex.down_proj, hf_w, ids, point).reshape(x.shape)
            assert not torch.equal(rounded, want)
        flipped = point.replace(routing_weight="fp32" if point["routing_weight"] == "rounded" else "rounded")
        other = moe_block_ref(x2, ex.gate_up_proj, ex.down_proj, logits, block.gate.top_k, flipped,
                              renormalize=norm_topk_prob).reshape(x.shape)
        assert not torch.equal(other, want), "the routing_weight site is visible here"
        if point != HF_POINT:
            assert not torch.equal(plain, got), "the engine's point differs from HF's own experts here"


def test_functional_moe_is_moe_ref_at_every_lattice_point():
    g = torch.Generator().manual_seed(11)
    tokens, hid, inter, experts, k = 7, 12, 6, 3, 2
    x = (torch.randn(tokens, hid, generator=g) * 2).bfloat16()
    w13 = (torch.randn(experts, 2 * inter, hid, generator=g) * 0.4).bfloat16()
    w2 = (torch.randn(experts, hid, inter, generator=g) * 0.4).bfloat16()
    w, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=g), -1), k)
    outs = set()
    with torch.no_grad():
        for p in MOE_SPEC.all_points():
            got = F.moe(x, w13, w2, w, ids, p)
            assert_same_bits(got, moe_ref(x.clone(), w13.clone(), w2.clone(), w, ids, p), p.label())
            outs.add(got.view(torch.int16).numpy().tobytes())
    assert len(outs) > 20, "the points must give different bits on these inputs"


def test_functional_moe_sees_weights_changed_in_place():
    # moe_ref memoizes its GEMMs by the identity of its inputs; an optimizer step changes weights in place.
    g = torch.Generator().manual_seed(12)
    x = torch.randn(5, 8, generator=g).bfloat16()
    w13 = (torch.randn(3, 8, 8, generator=g) * 0.5).bfloat16()
    w2 = (torch.randn(3, 8, 4, generator=g) * 0.5).bfloat16()
    w, ids = torch.topk(torch.softmax(torch.randn(5, 3, generator=g), -1), 2)
    with torch.no_grad():
        before = F.moe(x, w13, w2, w, ids, HF_POINT)
        w13.mul_(-3)
        after = F.moe(x, w13, w2, w, ids, HF_POINT)
    assert_same_bits(after, moe_ref(x.clone(), w13.clone(), w2.clone(), w, ids, HF_POINT))
    assert not torch.equal(before, after)


def test_functional_moe_refuses_what_does_not_fit():
    x = torch.zeros(3, 8, dtype=torch.bfloat16)
    w13, w2 = torch.zeros(2, 8, 8, dtype=torch.bfloat16), torch.zeros(2, 8, 4, dtype=torch.bfloat16)
    w, ids = torch.full((3, 1), 1.0), torch.zeros(3, 1, dtype=torch.long)
    with pytest.raises(ProfileMismatch, match="moe"):
        F.moe(x, w13, w2, w, ids, SWIGLU_SPEC.all_points()[0])
    with pytest.raises(InputError, match="shapes do not fit"):
        F.moe(x, w13[:, :6], w2, w, ids, HF_POINT)
    with pytest.raises(InputError, match="expert ids"):
        F.moe(x, w13, w2, w, ids + 2, HF_POINT)
    with pytest.raises(InputError, match="activation dtype"):
        F.moe(x.float(), w13.float(), w2.float(), w, ids, HF_POINT)
    with pytest.raises(RegionUnavailable, match="moe"):
        F.moe(x, w13, w2, w, ids, with_moe(TRANSFORMERS_PROFILE, UNMEASURED))


# -- the closed loop -------------------------------------------------------------------------------


@pytest.mark.parametrize("skip_native", [True, False], ids=["native-regions", "all-emulated"])
def test_hf_point_in_the_transformers_profile_changes_no_bit_of_the_logits(skip_native):
    model = tiny_moe(seed=5, mlp_only_layers=[1])
    ids = tiny_inputs(model, 20, batch=2, seed=6)
    prof = with_moe(TRANSFORMERS_PROFILE, measured(HF_POINT))
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
        with emulator.apply_profile(model, prof, skip_native=skip_native) as h:
            assert h.emulated[-1] == "moe"
            assert ("model.layers.1.mlp" in h.modules) == (not skip_native)  # the dense layer: the swiglu region
            got = model(ids, output_router_logits=True)
    assert_same_bits(got.logits, out.logits, "logits")
    for a, b in zip(got.router_logits, out.router_logits, strict=True):
        assert_same_bits(a, b, "router logits")
    assert_same_bits(got.aux_loss, out.aux_loss, "aux loss")


def test_an_engine_point_changes_the_logits_and_keeps_the_router_logits():
    model = tiny_moe(seed=5)
    ids = tiny_inputs(model, 20, batch=2, seed=6)
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
        with emulator.apply_profile(model, with_moe(TRANSFORMERS_PROFILE, measured(MEASURED["vllm-0.32.0-cpu"]))):
            got = model(ids, output_router_logits=True)
    assert not torch.equal(got.logits, out.logits)
    assert_same_bits(got.router_logits[0], out.router_logits[0], "first layer's router logits")


# -- backward --------------------------------------------------------------------------------------


def moe64(x, w13, w2, w, ids):
    """The FP32 function in FP64, token by token, nothing rounded (the straight-through semantics)."""
    inter = w13.shape[1] // 2
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e] @ x[t]
            hh = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            acc = acc + w[t, j] * (w2[e] @ hh)
        rows.append(acc)
    return torch.stack(rows)


def _backward_inputs(seed=21):
    g = torch.Generator().manual_seed(seed)
    tokens, hid, inter, experts, k = 11, 48, 24, 5, 2
    x = (torch.randn(tokens, hid, generator=g) * 1.5).bfloat16()
    w13 = (torch.randn(experts, 2 * inter, hid, generator=g) * 0.2).bfloat16()
    w2 = (torch.randn(experts, hid, inter, generator=g) * 0.2).bfloat16()
    w, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=g) * 2, -1), k)
    ids[0] = torch.tensor([4, 0])  # an expert id out of ascending order in a token's top-k
    dout = torch.randn(tokens, hid, generator=g).bfloat16()
    return x, w13, w2, w, ids, dout


def test_moe_backward_is_the_fp32_gradient_of_fp64_autograd():
    x, w13, w2, w, ids, dout = _backward_inputs()
    leaves = [t.double().requires_grad_() for t in (x, w13, w2, w)]
    (moe64(*leaves, ids) * dout.double()).sum().backward()
    got = moe_backward(x, w13, w2, w, ids, dout)
    for name, g, leaf in zip(("x", "w13", "w2", "topk_weights"), got, leaves, strict=True):
        assert g.dtype == torch.float32
        assert_fp32_close(g, leaf.grad, f"d {name}")
    # The tolerance sees one BF16 rounding: d w2 from the down GEMM's input h rounded (as the forward
    # rounds it) is outside.
    inter = w13.shape[1] // 2
    dw2_wrong = torch.zeros_like(got[2])
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e].float() @ x[t].float()
            h = to_act(torch.nn.functional.silu(gu[:inter]) * gu[inter:], torch.bfloat16).float()
            dw2_wrong[e] += torch.outer(w[t, j] * dout[t].float(), h)
    assert_fp32_close(dw2_wrong, leaves[2].grad, "d w2 with a rounded h, at BF16 precision", rel=2.0**-6)  # the formula is right
    with pytest.raises(AssertionError):
        assert_fp32_close(dw2_wrong, leaves[2].grad, "d w2 with a rounded h")


@pytest.mark.parametrize("weights", ["fp32", "bf16"])
def test_moe_op_gradients_are_the_fp32_gradient_rounded_to_each_inputs_dtype(weights):
    x, w13, w2, w, ids, dout = _backward_inputs(seed=22)
    if weights == "bf16":
        w = w.bfloat16()
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2, w)]
    F.moe(*leaves, ids, MEASURED["sglang-0.5.23-cpu"]).backward(dout)
    want = moe_backward(x, w13, w2, w, ids, dout)
    for name, leaf, g32 in zip(("x", "w13", "w2", "topk_weights"), leaves, want, strict=True):
        assert_same_bits(leaf.grad, to_act(g32, leaf.dtype) if leaf.dtype != torch.float32 else g32, f"d {name}")


@pytest.mark.parametrize("engine", ["sglang-0.5.23-cpu", "transformers-5.19-cpu"])
def test_the_router_gets_its_gradient_through_the_patched_block(engine):
    model = tiny_moe(seed=7, norm_topk_prob=True)
    block = model.model.layers[0].mlp
    x = hidden((1, 10, 64), seed=8)
    dout = hidden((1, 10, 64), seed=9)
    with emulator.apply_profile(model, with_moe(TRANSFORMERS_PROFILE, measured(MEASURED[engine]))):
        block(x).backward(dout)
    grads = {n: p.grad.float() for n, p in block.named_parameters()}
    assert set(grads) == {"gate.weight", "experts.gate_up_proj", "experts.down_proj"}
    # The FP64 block, routing included (softmax, top-k at the router's ids, renormalised), nothing rounded.
    x2 = x.reshape(-1, 64)
    _, ids = router_reference(block, x2)
    leaves = {n: p.detach().double().requires_grad_() for n, p in block.named_parameters()}
    probs = torch.softmax(x2.double() @ leaves["gate.weight"].T, -1).gather(-1, ids)
    w = probs / probs.sum(-1, keepdim=True)
    out = moe64(x2.double(), leaves["experts.gate_up_proj"], leaves["experts.down_proj"], w, ids)
    (out * dout.reshape(-1, 64).double()).sum().backward()
    for n, g in grads.items():
        ref = leaves[n].grad
        rel = float((g.double() - ref).norm() / ref.norm())
        # BF16 throughout: the router's matmul (and, at the HF point, its weights' cast) backward in BF16.
        assert g.abs().max() > 0 and rel < 1e-2, f"{n}: relative error {rel:.3g}"


# -- revert, refusals ------------------------------------------------------------------------------

UNMEASURED = {"sites": None, "evidence": {"status": "unavailable", "reason": "no fused-MoE path on this device"}}


def test_remove_gives_back_the_original_model_bit_for_bit():
    model = tiny_moe(seed=5, mlp_only_layers=[1])
    ids = tiny_inputs(model, 16, batch=1, seed=2)
    state = model_state(model)
    with torch.no_grad():
        before = model(ids).logits
        h = emulator.apply_profile(model, with_moe("vllm-0.32.0-cpu-inductor-bfloat16",
                                                   measured(MEASURED["vllm-0.32.0-cpu"])))
        patched = model(ids).logits
        copied = copy.deepcopy(model)  # a copy of a patched model is patched (its own handle)
        assert_same_bits(copied(ids).logits, patched, "deep copy")
        h.remove()
        after = model(ids).logits
    assert not torch.equal(patched, before)
    assert_same_bits(after, before, "logits after remove()")
    assert_untouched(model, state)
    assert emulator.handle_of(copied) is not None and emulator.handle_of(model) is None


def test_a_profile_without_a_measured_moe_entry_is_refused_and_the_model_untouched():
    model = tiny_moe(seed=5)
    state = model_state(model)
    prof = with_moe(TRANSFORMERS_PROFILE, UNMEASURED)
    with pytest.raises(RegionUnavailable, match=r"moe.*no fused-MoE path on this device"):
        emulator.apply_profile(model, prof)
    assert_untouched(model, state)
    # A dense model is unaffected by the moe entry.
    dense = tiny_model("qwen3", seed=1)
    with emulator.apply_profile(dense, prof, skip_native=False) as h:
        assert "moe" not in h.emulated


def test_a_model_with_only_dense_layers_needs_no_moe_entry():
    model = tiny_moe(seed=5, mlp_only_layers=[0, 1])
    with emulator.apply_profile(model, with_moe(TRANSFORMERS_PROFILE, UNMEASURED), skip_native=False) as h:
        assert "moe" not in h.emulated and "model.layers.0.mlp" in h.modules


# -- what falls out of the existing machinery ------------------------------------------------------


def test_fp32_master_weights_under_autocast_compute_the_bf16_models_bits():
    model = tiny_moe(seed=5, mlp_only_layers=[1])
    ids = tiny_inputs(model, 12, batch=2, seed=1)
    prof = with_moe(TRANSFORMERS_PROFILE, measured(MEASURED["vllm-0.32.0-cpu"]))
    master = copy.deepcopy(model).float()
    master.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.clone()  # HF keeps it FP32 when loading
    with torch.no_grad():
        with emulator.apply_profile(model, prof):
            want = model(ids).logits
        with emulator.apply_profile(master, prof), torch.autocast("cpu", dtype=torch.bfloat16):
            got = master(ids).logits
    assert_same_bits(got, want, "FP32 master weights under autocast vs BF16 weights")


def test_compiling_a_patched_moe_model_is_refused():
    from emulator.errors import CompileUnsupported

    model = tiny_moe(seed=5)
    ids = tiny_inputs(model, 8, batch=1, seed=1)
    with emulator.apply_profile(model, with_moe(TRANSFORMERS_PROFILE, measured(HF_POINT)), skip_native=False):
        with pytest.raises(CompileUnsupported, match="sparse MoE block"):
            torch.compile(model)(ids)
    torch.compiler.reset()


def test_class_patch_of_the_family():
    prof = with_moe(TRANSFORMERS_PROFILE, measured(HF_POINT))
    with emulator.patch_qwen3_moe(prof):
        model = tiny_moe(seed=5)
        h = emulator.handle_of(model)
        assert h is not None and h.family.name == "qwen3_moe" and "moe" in h.emulated
    h.remove()


@pytest.mark.parametrize("engine", ["vllm-0.32.0-cpu", "transformers-5.19-cpu"])
def test_the_experts_get_the_routers_weights_in_the_order_the_point_lists_them(engine, monkeypatch):
    """softmax_topk (vLLM): the experts of torch.topk(logits, sorted=False), in that order (the order
    the weighted outputs are added in), with the softmax of their logits; softmax_all (HF): the
    router's own ids and weights. Checked on what reaches the experts op."""
    point = MEASURED[engine]
    model = tiny_moe(seed=5, num_experts=8, num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[1])
    block = model.model.layers[0].mlp
    x = hidden((1, 64, 64), seed=6)
    x2 = x.reshape(-1, 64)
    seen = []
    real = F.moe

    def spy(x_, w13, w2, weights, ids, *args, **kw):
        seen.append((weights, ids))
        return real(x_, w13, w2, weights, ids, *args, **kw)

    monkeypatch.setattr(F, "moe", spy)
    with torch.no_grad(), emulator.apply_profile(model, with_moe(TRANSFORMERS_PROFILE, measured(point)), skip_native=False):
        block(x)
    (weights, ids), = seen
    logits = torch.nn.functional.linear(x2, block.gate.weight)
    _, hf_w, hf_ids = block.gate(x2)
    if point["router"] == "softmax_topk":
        v, unsorted = torch.topk(logits, 4, dim=-1, sorted=False)
        assert torch.equal(ids, unsorted) and not torch.equal(ids, hf_ids)  # another order here
        assert torch.equal(weights, torch.softmax(v.float(), -1))
    else:
        assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_w)
