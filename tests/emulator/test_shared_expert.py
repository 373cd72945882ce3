"""Qwen2-MoE under apply_profile: each sparse MoE block's routed experts compute at the profile's ``moe``
point and its gated shared expert, with the sum of both, at the ``shared_expert`` point
(``functional.shared_expert``, bit for bit ``shared_block_ref``); with ``sum`` FP32 the block's output
reaches the next residual add unrounded; the backward is the straight-through FP32 gradient; HF's
own point changes no bit of the logits; the patch reverts bit for bit, and a profile without a
measured shared_expert entry is refused with the model untouched."""

from __future__ import annotations

import copy

import pytest
import torch

import emulator
from emulator import functional as F
from emulator.errors import InputError, ProfileMismatch, RegionUnavailable, UnsupportedModel
from emulator.ops.shared_expert import shared_expert_backward
from engineprofiles.models import tiny_inputs, tiny_model
from engineprofiles.regions import MOE_SPEC, SHARED_EXPERT_SPEC, add_rmsnorm_ref, moe_block_ref, shared_block_ref
from engineprofiles.rounding import round_to, to_act
from engineprofiles.schema import with_points
from engineprofiles.store import get_profile

from .helpers import assert_fp32_close, assert_same_bits, assert_untouched, model_state

BF = torch.bfloat16
R, FP = "rounded", "fp32"
TRANSFORMERS_PROFILE = "transformers-5.19.0-cpu-eager-bfloat16"
VLLM_PROFILE = "vllm-0.32.0-cpu-inductor-bfloat16"

# The moe points measured on the engines (tests/emulator/test_moe.py): HF's own, and vLLM's compiled
# one, whose router (softmax_topk) differs from HF's without renormalization too.
HF_MOE = MOE_SPEC.point(
    gate_up=R, silu=R, expert_out=R, routing_weight=R, weighted=R, combine=FP,
    router="softmax_all", silu_formula="fused", gemm_order="library", combine_order="topk", combine_fma="none")
VLLM_MOE = MOE_SPEC.point(
    gate_up=FP, silu=FP, expert_out=FP, routing_weight=FP, weighted=FP, combine=FP,
    router="softmax_topk", silu_formula="fused", gemm_order="sequential", combine_order="topk", combine_fma="fma")
# HF's Qwen2MoeSparseMoeBlock then its layer's residual add: every site rounded
# (tests/engineprofiles/test_shared_expert.py checks it on HF's block).
HF_SHARED = SHARED_EXPERT_SPEC.point(dict(silu=R, gate=R, weighted=R, sum=R), dict(silu_formula="fused"))
ALL_FP32 = HF_SHARED.replace(silu=FP, gate=FP, weighted=FP, sum=FP)
# Each site flipped from HF's point, all of them, and the other silu formulas.
POINTS = {
    "hf": HF_SHARED,
    **{f"{s}-fp32": HF_SHARED.replace(**{s: FP}) for s in SHARED_EXPERT_SPEC.site_names},
    "all-fp32": ALL_FP32,
    "all-fp32-x_sigmoid": ALL_FP32.replace(silu_formula="x_sigmoid"),
    "hf-x_div_1p_exp": HF_SHARED.replace(silu_formula="x_div_1p_exp"),
}


def profile(shared=HF_SHARED, moe=HF_MOE, base=TRANSFORMERS_PROFILE):
    """Shipped profile ``base`` with these moe and shared_expert points (None: unavailable)."""
    return with_points(get_profile(base), {"moe": moe, "shared_expert": shared})


def tiny_q2m(seed=1, **overrides):
    """engineprofiles.models.tiny_model("qwen2_moe") (8 experts of width 128, top-2, not renormalized,
    a shared expert of width 256), its routers spread so that the top-k weights differ (at
    0.02 N(0, 1) the softmaxes are near uniform)."""
    model = tiny_model("qwen2_moe", seed=seed, **overrides)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.mul_(20)
    return model


def shared_weights(block):
    se = block.shared_expert
    return (torch.cat((se.gate_proj.weight, se.up_proj.weight)), se.down_proj.weight,
            block.shared_expert_gate.weight)


def block_ref(block, x2, moe_point, shared_point):
    """The block at these points, from the references: route + moe_ref, then shared_block_ref."""
    ex = block.experts
    logits = torch.nn.functional.linear(x2, block.gate.weight)
    routed = moe_block_ref(x2, ex.gate_up_proj, ex.down_proj, logits, block.gate.top_k, moe_point,
                           renormalize=block.gate.norm_topk_prob)
    return shared_block_ref(x2, *shared_weights(block), routed, shared_point), routed


def hidden(shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(BF)


def flip(point, site):
    return point.replace(**{site: FP if point[site] == R else R})


# -- forward: the patched block is moe_ref + shared_block_ref at the profile's points, bitwise -------


@pytest.mark.parametrize("moe", ["hf", "vllm"])
@pytest.mark.parametrize("name", list(POINTS))
def test_patched_sparse_block_is_the_references_at_the_profiles_points_bitwise(name, moe):
    point = POINTS[name]
    moe_point = HF_MOE if moe == "hf" else VLLM_MOE
    model = tiny_q2m(seed=3, mlp_only_layers=[1])
    block = model.model.layers[0].mlp
    assert not block.gate.norm_topk_prob  # Qwen2-MoE's default: the top-k weights not renormalized
    x = hidden((2, 9, 256), seed=4)
    x2 = x.reshape(-1, 256)
    with torch.no_grad():
        plain = block(x)
        with emulator.apply_profile(model, profile(point, moe_point), skip_native=False) as h:
            assert h.emulated[-2:] == ("moe", "shared_expert") and "model.layers.0.mlp" in h.modules
            got = block(x)
        want, _ = block_ref(block, x2, moe_point, point)
    assert len(torch.unique(block.gate(x2)[2])) == 8, "every expert routed to"
    if point["sum"] == FP:  # the FP32 block output, handed on unrounded
        assert got.dtype == torch.float32 and not torch.equal(got, round_to(got, BF))
        assert_same_bits(got.reshape(-1, 256), want, f"{name}: patched block vs the references (FP32 m)")
    else:
        assert_same_bits(got.reshape(-1, 256), want.to(BF), f"{name}: patched block vs the references")
    # The check can fail: each site flipped (the others kept) gives other values on these inputs.
    for site in SHARED_EXPERT_SPEC.site_names:
        other, _ = block_ref(block, x2, moe_point, flip(point, site))
        assert not torch.equal(other.float(), got.reshape(-1, 256).float()), f"{name}: site {site} flipped"
    # ... and so does the routed part at another moe point.
    other, _ = block_ref(block, x2, VLLM_MOE if moe == "hf" else HF_MOE, point)
    assert not torch.equal(other.float(), got.reshape(-1, 256).float()), "the moe point is visible"
    if name == "hf" and moe == "hf":
        assert_same_bits(got, plain, "HF's point is HF's own block")
    elif moe != "hf" or any(point[s] != HF_SHARED[s] for s in SHARED_EXPERT_SPEC.site_names):
        # (a silu formula alone, before a rounded silu, need not change a bit on these inputs)
        assert not torch.equal(got.float(), plain.float()), "another point than HF's changes the block"


def test_functional_shared_expert_is_the_reference_at_every_lattice_point():
    g = torch.Generator().manual_seed(11)
    tokens, hid, inter = 13, 24, 10
    x = (torch.randn(tokens, hid, generator=g) * 1.5).to(BF)
    wgu = (torch.randn(2 * inter, hid, generator=g) * 0.3).to(BF)
    wd = (torch.randn(hid, inter, generator=g) * 0.3).to(BF)
    wg = (torch.randn(1, hid, generator=g) * 0.3).to(BF)
    routed = (torch.randn(tokens, hid, generator=g) * 0.5).to(BF)
    outs = set()
    with torch.no_grad():
        for p in SHARED_EXPERT_SPEC.all_points():
            got = F.shared_expert(x, wgu, wd, wg, routed, p)
            want = shared_block_ref(x.clone(), wgu.clone(), wd.clone(), wg.clone(), routed.clone(), p)
            assert_same_bits(got, want if p["sum"] == FP else want.to(BF), p.label())
            outs.add(got.float().numpy().tobytes())
    assert len(outs) > 12, "the points must give different values on these inputs"


def test_functional_shared_expert_refuses_what_does_not_fit():
    x = torch.zeros(3, 8, dtype=BF)
    wgu, wd, wg = torch.zeros(8, 8, dtype=BF), torch.zeros(8, 4, dtype=BF), torch.zeros(1, 8, dtype=BF)
    with pytest.raises(ProfileMismatch, match="shared_expert"):
        F.shared_expert(x, wgu, wd, wg, x, HF_MOE)
    with pytest.raises(InputError, match="do not fit"):
        F.shared_expert(x, wgu[:6], wd, wg, x, HF_SHARED)
    with pytest.raises(InputError, match="activation dtype"):
        F.shared_expert(x.float(), wgu.float(), wd.float(), wg.float(), x.float(), HF_SHARED)
    with pytest.raises(RegionUnavailable, match="shared_expert"):
        F.shared_expert(x, wgu, wd, wg, x, profile(None))


# -- the closed loop -------------------------------------------------------------------------------


@pytest.mark.parametrize("skip_native", [True, False], ids=["native-regions", "all-emulated"])
def test_hf_points_in_the_transformers_profile_change_no_bit_of_the_logits(skip_native):
    model = tiny_q2m(seed=5, num_hidden_layers=3, mlp_only_layers=[1])
    ids = tiny_inputs(model, 20, batch=2, seed=6)
    prof = profile(HF_SHARED, get_profile(TRANSFORMERS_PROFILE).point("moe"))
    assert prof.point("moe") == HF_MOE  # the shipped profile's measured moe point
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
        with emulator.apply_profile(model, prof, skip_native=skip_native) as h:
            assert h.emulated[-2:] == ("moe", "shared_expert")
            assert ("model.layers.1.mlp" in h.modules) == (not skip_native)  # the dense layer: the swiglu region
            got = model(ids, output_router_logits=True)
    assert_same_bits(got.logits, out.logits, "logits")
    for a, b in zip(got.router_logits, out.router_logits, strict=True):
        assert_same_bits(a, b, "router logits")
    assert_same_bits(got.aux_loss, out.aux_loss, "aux loss")


SHIPPED = (TRANSFORMERS_PROFILE, VLLM_PROFILE, "vllm-0.32.0-cpu-eager-bfloat16", "sglang-0.5.23-cpu-eager-bfloat16")


@pytest.mark.parametrize("name", SHIPPED)
def test_the_shipped_profiles_patch_the_sparse_blocks_at_their_points_or_are_refused(name):
    """As probed: HF's own profile changes no logit bit; the engines' blocks are the references at
    their profile's points (vLLM compiled: sum FP32, handed on); a profile whose shared expert could
    not be probed (SGLang on this CPU) is refused, the model untouched."""
    prof = get_profile(name)
    model = tiny_q2m(seed=5)
    ids = tiny_inputs(model, 16, batch=2, seed=6)
    block = model.model.layers[1].mlp
    seen = []
    block.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    if not prof.available("shared_expert"):
        state = model_state(model)
        with pytest.raises(RegionUnavailable, match="no measured shared_expert entry"):
            emulator.apply_profile(model, prof)
        assert_untouched(model, state)
        return
    with torch.no_grad():
        out = model(ids).logits
        with emulator.apply_profile(model, prof) as h:
            assert h.emulated[-2:] == ("moe", "shared_expert")
            got = model(ids).logits
            m = block(seen[-1])
        want, _ = block_ref(block, seen[-1].reshape(-1, 256), prof.point("moe"), prof.point("shared_expert"))
    if prof.point("shared_expert")["sum"] == FP:
        assert m.dtype == torch.float32 and "add_rmsnorm" in h.emulated
    assert_same_bits(m.reshape(-1, 256), want.to(m.dtype), f"{name}: the patched block")
    if name == TRANSFORMERS_PROFILE:
        assert_same_bits(got, out, "HF's own profile changes no logit bit")
    else:
        assert not torch.equal(got, out)


@pytest.mark.parametrize("name", ["sum-fp32", "gate-fp32"])
def test_an_engine_point_changes_the_logits(name):
    model = tiny_q2m(seed=5)
    ids = tiny_inputs(model, 20, batch=2, seed=6)
    with torch.no_grad():
        out = model(ids).logits
        with emulator.apply_profile(model, profile(POINTS[name])) as h:
            assert ("add_rmsnorm" in h.emulated) == (name == "sum-fp32")  # the residual path carries FP32 m
            got = model(ids).logits
    assert not torch.equal(got, out)


# -- sum=fp32: the block's output reaches the next residual add unrounded ----------------------------


@pytest.mark.parametrize("skip_native", [True, False], ids=["native-norms", "all-emulated"])
def test_with_sum_fp32_the_next_residual_is_the_fp32_block_output_plus_the_residual_rounded_once(
        skip_native, monkeypatch):
    """Layer 1's input residual add: round(fp32(m) + residual), where m is layer 0's block output from
    the references (FP32); a block or layer that rounded m first gives round(round(m) + residual),
    which differs here."""
    point = POINTS["sum-fp32"]
    model = tiny_q2m(seed=7)
    ids = tiny_inputs(model, 24, batch=1, seed=8)
    block = model.model.layers[0].mlp
    seen_block, adds, outs = [], [], []
    block.register_forward_pre_hook(lambda mod, args: seen_block.append(args[0]))
    model.model.layers[0].register_forward_hook(lambda mod, args, out: outs.append(out))
    real = F.add_rmsnorm

    def spy(x, residual, *args, **kw):
        out = real(x, residual, *args, **kw)
        adds.append((x, residual, out))
        return out

    monkeypatch.setattr(F, "add_rmsnorm", spy)
    prof = profile(point)
    with torch.no_grad(), emulator.apply_profile(model, prof, skip_native=skip_native):
        model(ids)
    # layer 0: post-attention add; layer 1: input add, post-attention add; the final norm's add.
    assert len(adds) == 4
    (x2,) = seen_block
    m, _ = block_ref(block, x2.reshape(-1, 256), prof.point("moe"), point)
    assert m.dtype == torch.float32 and not torch.equal(m, round_to(m, BF))
    m_in, r_in, (_, r_next) = adds[1]
    assert m_in.dtype == torch.float32, "the block output reaches the add in FP32"
    assert_same_bits(m_in.reshape(-1, 256), m, "the m the next add gets")
    r0 = adds[0][2][1].reshape(-1, 256)  # the residual after layer 0's post-attention add
    assert_same_bits(r_in.reshape(-1, 256), r0, "the residual the next add gets")
    want = (m + r0.float()).to(BF)  # one rounding
    assert_same_bits(r_next.reshape(-1, 256), want, "round(fp32(m) + residual)")
    assert not torch.equal(want, (round_to(m, BF) + r0.float()).to(BF)), "rounding m first differs here"
    # The hidden state layer 0 returns (HF's output_hidden_states) is that residual too.
    assert_same_bits(outs[0].reshape(-1, 256), want, "layer 0's output hidden state")
    # The layer's output x (the attention's input) too: add_rmsnorm at the profile's point from FP32 m.
    ln = model.model.layers[1].input_layernorm
    out, _ = add_rmsnorm_ref(m, r0, ln.weight, ln.variance_epsilon, prof.point("add_rmsnorm"), dtype=BF)
    assert_same_bits(adds[1][2][0].reshape(-1, 256), out, "layer 1's normalized input")


# -- backward --------------------------------------------------------------------------------------


def shared64(x, wgu, wd, wg, routed):
    """The FP32 function in FP64, nothing rounded (the straight-through semantics)."""
    inter = wd.shape[1]
    gu = x @ wgu.T
    y = (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]) @ wd.T
    return routed + torch.sigmoid(x @ wg.T) * y


def _backward_inputs(seed=21):
    g = torch.Generator().manual_seed(seed)
    tokens, hid, inter = 19, 48, 40
    x = (torch.randn(tokens, hid, generator=g) * 1.5).to(BF)
    wgu = (torch.randn(2 * inter, hid, generator=g) * 0.2).to(BF)
    wd = (torch.randn(hid, inter, generator=g) * 0.2).to(BF)
    wg = (torch.randn(1, hid, generator=g) * 0.3).to(BF)
    routed = (torch.randn(tokens, hid, generator=g) * 0.5).to(BF)
    dm = torch.randn(tokens, hid, generator=g).to(BF)
    return x, wgu, wd, wg, routed, dm


def test_shared_expert_backward_is_the_fp32_gradient_of_fp64_autograd():
    x, wgu, wd, wg, routed, dm = _backward_inputs()
    leaves = [t.double().requires_grad_() for t in (x, wgu, wd, wg, routed)]
    (shared64(*leaves) * dm.double()).sum().backward()
    got = shared_expert_backward(x, wgu, wd, wg, dm)
    for name, g, leaf in zip(("x", "w_gate_up", "w_down", "w_gate", "routed"), got, leaves, strict=True):
        assert g.dtype == torch.float32 and g.shape == leaf.shape
        assert_fp32_close(g, leaf.grad, f"d {name}")
    # The tolerance sees one BF16 rounding: d w_down from the down GEMM's input h rounded (as the forward
    # rounds it) is outside it; and d w_gate from the gate rounded (sg * (1 - sg) of the rounded sg).
    inter = wd.shape[1]
    gu = x.float() @ wgu.float().T
    h = to_act(torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:], BF).float()
    sg = torch.sigmoid(x.float() @ wg.float().T)
    dwd_wrong = (sg * dm.float()).T @ h
    assert_fp32_close(dwd_wrong, leaves[2].grad, "d w_down with a rounded h, at BF16 precision", rel=2.0**-6)  # formula right
    with pytest.raises(AssertionError):
        assert_fp32_close(dwd_wrong, leaves[2].grad, "d w_down with a rounded h")
    y = (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]) @ wd.float().T
    sgr = to_act(sg, BF).float()
    dwg_wrong = ((dm.float() * y).sum(-1, keepdim=True) * sgr * (1 - sgr)).T @ x.float()
    assert_fp32_close(dwg_wrong, leaves[3].grad, "d w_gate with a rounded gate, at BF16 precision", rel=2.0**-6)
    with pytest.raises(AssertionError):
        assert_fp32_close(dwg_wrong, leaves[3].grad, "d w_gate with a rounded gate")


@pytest.mark.parametrize("name", ["hf", "all-fp32"])
def test_shared_expert_op_gradients_are_the_fp32_gradient_rounded_to_each_inputs_dtype(name):
    x, wgu, wd, wg, routed, dm = _backward_inputs(seed=22)
    leaves = [t.clone().requires_grad_() for t in (x, wgu, wd, wg, routed)]
    m = F.shared_expert(*leaves, POINTS[name])
    assert m.dtype == (torch.float32 if name == "all-fp32" else BF)
    m.backward(dm.to(m.dtype))
    want = shared_expert_backward(x, wgu, wd, wg, dm)
    for n, leaf, g32 in zip(("x", "w_gate_up", "w_down", "w_gate", "routed"), leaves, want, strict=True):
        assert_same_bits(leaf.grad, to_act(g32, BF), f"d {n}")


@pytest.mark.parametrize("name", ["hf", "sum-fp32"])
def test_the_block_and_model_get_their_gradients_through_the_patched_block(name):
    """The patched block's parameter gradients against FP64 autograd of the whole block (router
    softmax and top-k at the router's ids, not renormalized, the routed experts, the shared expert),
    nothing rounded; then a loss through the patched model (the FP32 m carried to the next layer)
    reaches every parameter of the sparse blocks."""
    model = tiny_q2m(seed=7)
    block = model.model.layers[0].mlp
    x = hidden((1, 10, 256), seed=8)
    dout = hidden((1, 10, 256), seed=9)
    prof = profile(POINTS[name])
    with emulator.apply_profile(model, prof):
        out = block(x)
        out.backward(dout.to(out.dtype))
    grads = {n: p.grad.float() for n, p in block.named_parameters()}
    assert set(grads) == {"gate.weight", "experts.gate_up_proj", "experts.down_proj", "shared_expert.gate_proj.weight",
                          "shared_expert.up_proj.weight", "shared_expert.down_proj.weight", "shared_expert_gate.weight"}
    x2 = x.reshape(-1, 256).double()
    ids = block.gate(x.reshape(-1, 256))[2]
    lv = {n: p.detach().double().requires_grad_() for n, p in block.named_parameters()}
    w = torch.softmax(x2 @ lv["gate.weight"].T, -1).gather(-1, ids)
    inter = lv["experts.down_proj"].shape[2]
    routed = torch.zeros_like(x2)
    for j in range(ids.shape[1]):
        w13, w2 = lv["experts.gate_up_proj"][ids[:, j]], lv["experts.down_proj"][ids[:, j]]
        gu = torch.einsum("th,tih->ti", x2, w13)
        hh = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        routed = routed + w[:, j, None] * torch.einsum("ti,thi->th", hh, w2)
    wgu = torch.cat((lv["shared_expert.gate_proj.weight"], lv["shared_expert.up_proj.weight"]))
    ref = shared64(x2, wgu, lv["shared_expert.down_proj.weight"], lv["shared_expert_gate.weight"], routed)
    (ref * dout.reshape(-1, 256).double()).sum().backward()
    for n, g in grads.items():
        r = lv[n].grad
        rel = float((g.double() - r).norm() / r.norm())
        # BF16 throughout: the router's matmul backward in BF16, each gradient stored in BF16.
        assert g.abs().max() > 0 and rel < 1e-2, f"{n}: relative error {rel:.3g}"
    model.zero_grad()
    ids = tiny_inputs(model, 12, batch=1, seed=3)
    with emulator.apply_profile(model, prof):
        model(ids, labels=ids).loss.backward()
    for i in (0, 1):
        for n, p in model.model.layers[i].mlp.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, f"layer {i} {n}"


# -- revert, refusals ------------------------------------------------------------------------------


def test_remove_gives_back_the_original_model_bit_for_bit():
    model = tiny_q2m(seed=5, mlp_only_layers=[1])
    ids = tiny_inputs(model, 16, batch=1, seed=2)
    state = model_state(model)
    with torch.no_grad():
        before = model(ids).logits
        h = emulator.apply_profile(model, profile(POINTS["sum-fp32"], VLLM_MOE, base=VLLM_PROFILE))
        patched = model(ids).logits
        copied = copy.deepcopy(model)  # a copy of a patched model is patched (its own handle)
        assert_same_bits(copied(ids).logits, patched, "deep copy")
        h.remove()
        after = model(ids).logits
    assert not torch.equal(patched, before)
    assert_same_bits(after, before, "logits after remove()")
    assert_untouched(model, state)
    assert emulator.handle_of(copied) is not None and emulator.handle_of(model) is None


@pytest.mark.parametrize("missing", ["shared_expert", "moe"])
def test_a_profile_without_a_measured_entry_is_refused_and_the_model_untouched(missing):
    model = tiny_q2m(seed=5)
    state = model_state(model)
    prof = profile(None) if missing == "shared_expert" else profile(HF_SHARED, None)
    with pytest.raises(RegionUnavailable, match=rf"no measured {missing} entry .*model.layers.0.mlp and 1 more"):
        emulator.apply_profile(model, prof)
    assert_untouched(model, state)


def test_models_without_a_shared_expert_need_no_shared_expert_entry():
    prof = profile(None)
    dense = tiny_q2m(seed=5, mlp_only_layers=[0, 1])  # every layer a dense Qwen2MoeMLP
    with emulator.apply_profile(dense, prof, skip_native=False) as h:
        assert "moe" not in h.emulated and "shared_expert" not in h.emulated and "model.layers.0.mlp" in h.modules
    qwen3_moe = tiny_model("qwen3_moe", seed=1)  # sparse blocks without a shared expert
    with emulator.apply_profile(qwen3_moe, prof) as h:
        assert "moe" in h.emulated and "shared_expert" not in h.emulated


def test_a_shared_expert_the_patch_cannot_read_is_refused_and_the_model_untouched():
    model = tiny_q2m(seed=5)
    block = model.model.layers[1].mlp
    block.shared_expert_gate = torch.nn.Linear(256, 1, bias=True, dtype=BF)
    state = model_state(model)
    with pytest.raises(UnsupportedModel, match=r"layers.1.mlp.shared_expert_gate is a nn.Linear with a bias"):
        emulator.apply_profile(model, profile())
    assert_untouched(model, state)

    class Wrapped(torch.nn.Module):  # an adapter around the projection (as PEFT's LoRA layers)
        def __init__(self, base):
            super().__init__()
            self.base_layer = base

        def forward(self, x):
            return self.base_layer(x)

    model = tiny_q2m(seed=5)
    model.model.layers[0].mlp.shared_expert.up_proj = Wrapped(model.model.layers[0].mlp.shared_expert.up_proj)
    state = model_state(model)
    with pytest.raises(UnsupportedModel, match=r"shared_expert.up_proj is a Wrapped"):
        emulator.apply_profile(model, profile())
    assert_untouched(model, state)


# -- what falls out of the existing machinery ------------------------------------------------------


def test_fp32_master_weights_under_autocast_compute_the_bf16_models_bits():
    model = tiny_q2m(seed=5, mlp_only_layers=[1])
    ids = tiny_inputs(model, 12, batch=2, seed=1)
    prof = profile(POINTS["sum-fp32"], VLLM_MOE)
    master = copy.deepcopy(model).float()
    master.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.clone()  # HF keeps it FP32 when loading
    with torch.no_grad():
        with emulator.apply_profile(model, prof):
            want = model(ids).logits
        with emulator.apply_profile(master, prof), torch.autocast("cpu", dtype=BF):
            got = master(ids).logits
    assert_same_bits(got, want, "FP32 master weights under autocast vs BF16 weights")


def test_class_patch_of_the_family():
    prof = profile()
    with emulator.patch_qwen2_moe(prof):
        model = tiny_q2m(seed=5)
        h = emulator.handle_of(model)
        assert h is not None and h.family.name == "qwen2_moe" and h.emulated[-2:] == ("moe", "shared_expert")
    h.remove()


def test_compiling_a_patched_qwen2_moe_model_is_refused():
    from emulator.errors import CompileUnsupported

    model = tiny_q2m(seed=5)
    ids = tiny_inputs(model, 8, batch=1, seed=1)
    with emulator.apply_profile(model, profile(POINTS["sum-fp32"]), skip_native=False):
        with pytest.raises(CompileUnsupported, match="sparse MoE block"):
            torch.compile(model)(ids)
    torch.compiler.reset()
