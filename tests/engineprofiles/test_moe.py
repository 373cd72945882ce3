"""The MoE experts' reference (engineprofiles/regions/moe.py) against hand-written formulas and
HF's own experts, bit for bit."""

import pytest
import torch

from engineprofiles.regions import MOE_SPEC, moe_ref, sequential_linear

F, R = "fp32", "rounded"
BF = torch.bfloat16


def _inputs(t=7, h=64, i=32, e=4, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(BF)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.2).to(BF)
    w2 = (torch.randn(e, h, i, generator=g) * 0.2).to(BF)
    probs = torch.softmax(torch.randn(t, e, generator=g), -1)
    w, ids = torch.topk(probs, k, -1)
    return x, w13, w2, (w / w.sum(-1, keepdim=True)).contiguous(), ids


def test_sequential_linear_adds_the_products_in_order_one_rounding_each():
    x, w13, _, _, _ = _inputs(t=3, h=40)
    got = sequential_linear(x, w13[0])
    want = torch.empty_like(got)
    for m in range(x.shape[0]):
        for n in range(w13.shape[1]):
            acc = torch.zeros((), dtype=torch.float32)
            for k in range(x.shape[1]):
                acc = acc + x[m, k].float() * w13[0, n, k].float()  # exact product, one rounding per add
            want[m, n] = acc
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    # ... which is not torch's FP32 matmul everywhere (else the variant would be pointless)
    x, w13, _, _, _ = _inputs(t=16, h=512, seed=3)
    assert not torch.equal(sequential_linear(x, w13[0]), x.float() @ w13[0].float().T)


def test_the_fused_kernel_point_by_hand():
    """gate/up and the expert outputs in FP32, silu in FP32, the product rounded once, the weighted
    sum in FP32 by fused multiply-adds in top-k order, rounded once."""
    x, w13, w2, tw, ids = _inputs()
    p = MOE_SPEC.point(dict(gate_up=F, silu=F, expert_out=F, routing_weight=F, weighted=F, combine=F),
                       dict(gemm_order="sequential", combine_fma="fma"))
    want = torch.empty_like(x)
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = sequential_linear(x[t:t + 1], w13[e])[0]
            h = (torch.nn.functional.silu(gu[:32]) * gu[32:]).to(BF)
            y = sequential_linear(h[None], w2[e])[0]
            # fma: the product exact in FP64, one rounding of the sum to FP32
            acc = (tw[t, j].double() * y.double() + acc).float().double()
        want[t] = acc.float().to(BF)
    assert torch.equal(moe_ref(x, w13, w2, tw, ids, p).view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_hf_qwen3_moe_experts_equal_the_reference_at_their_point(impl):
    """HF's experts, both implementations, with the router's cast of the weights to BF16: eager
    adds BF16 weighted outputs into a BF16 buffer expert by expert (index_add: every partial sum
    rounded, ascending expert id); grouped_mm sums the BF16 weighted outputs in FP32 in top-k order."""
    pytest.importorskip("transformers")
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    x, w13, w2, tw, ids = _inputs(t=9, e=4, k=3, seed=1)
    cfg = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=3)
    cfg._experts_implementation = impl
    experts = Qwen3MoeExperts(cfg).to(BF)
    with torch.no_grad():
        experts.gate_up_proj.copy_(w13)
        experts.down_proj.copy_(w2)
        got = experts(x, ids, tw.to(BF))
    sites = dict(gate_up=R, silu=R, expert_out=R, routing_weight=R, weighted=R,
                 combine=R if impl == "eager" else F)
    p = MOE_SPEC.point(sites, dict(gemm_order="library", combine_order="expert" if impl == "eager" else "topk",
                                   combine_fma="none"))
    assert torch.equal(moe_ref(x, w13, w2, tw, ids, p).view(torch.int16), got.view(torch.int16))
    other = p.replace(combine=F if impl == "eager" else R)
    assert not torch.equal(moe_ref(x, w13, w2, tw, ids, other), got)  # the combine site is visible here


def test_the_lattice_canonicalizes_the_fma_of_a_rounded_product():
    pts = MOE_SPEC.all_points()
    assert all(p["combine_fma"] == "none" for p in pts if p["weighted"] == R)
    assert all(p["routing_weight"] == R for p in pts if p["router"] == "softmax_topk_act")
    # 5 sites besides routing_weight, (router x routing_weight: 2 x 2 + the act router's 1) x silu_formula x
    # gemm_order x combine_order x (fma, none | none)
    assert len(pts) == 2 ** 4 * 5 * 3 * 2 * 2 * 3


@pytest.mark.parametrize("bad", ["w13_shape", "ids_range", "dtype", "topk_shape"])
def test_bad_inputs_are_refused_naming_what_is_wrong(bad):
    x, w13, w2, tw, ids = _inputs()
    p = MOE_SPEC.all_points()[0]
    if bad == "w13_shape":
        w13 = w13[:, :, :-1]
    elif bad == "ids_range":
        ids = ids.clone()
        ids[0, 0] = 4
    elif bad == "dtype":
        w2 = w2.float()
    else:
        tw = tw[:, :1]
    with pytest.raises(ValueError, match="moe:"):
        moe_ref(x, w13, w2, tw, ids, p)


def test_the_gemm_memo_is_opt_in_and_never_answers_for_inputs_changed_in_place():
    x, w13, w2, tw, ids = _inputs()
    p = MOE_SPEC.all_points()[0]
    before = moe_ref(x, w13, w2, tw, ids, p)
    with torch.no_grad():
        w13.mul_(2)  # an optimizer step: same tensor object, new values
    assert not torch.equal(moe_ref(x, w13, w2, tw, ids, p), before)  # no memo by default
    from engineprofiles.regions.moe import GemmMemo

    memo = GemmMemo()
    first = moe_ref(x, w13, w2, tw, ids, p, memo=memo)
    assert torch.equal(moe_ref(x, w13, w2, tw, ids, p, memo=memo), first)
    with torch.no_grad():
        w13.mul_(0.5)
    assert torch.equal(moe_ref(x, w13, w2, tw, ids, p, memo=memo), before)  # the version counter moved


def test_the_routers_by_hand_and_hf_s_router_at_its_point():
    """softmax_all: softmax of every logit, top k (descending), renormalized (HF's router before its
    cast, checked against Qwen3MoeTopKRouter fed the logits through an identity gate); softmax_topk:
    softmax of the top-k logits, in the order torch.topk(sorted=False) lists them (vLLM's CPU router)."""
    from engineprofiles.regions import route

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(9, 8, generator=g).to(BF)
    p_all = MOE_SPEC.point(dict(gate_up=R, silu=R, expert_out=R, routing_weight=R, weighted=R, combine=F))
    p_top = p_all.replace(router="softmax_topk")
    w, ids = route(logits, 3, p_all)
    p = torch.softmax(logits.float(), -1)
    top, want_ids = p.topk(3)
    assert torch.equal(ids, want_ids) and torch.equal(w, top / top.sum(-1, keepdim=True))
    w2, ids2 = route(logits, 3, p_top)
    v, unsorted = torch.topk(logits, 3, sorted=False)
    assert torch.equal(ids2, unsorted) and torch.equal(w2, torch.softmax(v.float(), -1))
    assert torch.equal(ids2.sort(-1).values, ids.sort(-1).values)  # the same experts
    pytest.importorskip("transformers")
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=8, num_experts=8, num_experts_per_tok=3,
                                               norm_topk_prob=True)).to(BF)
    with torch.no_grad():
        router.weight.copy_(torch.eye(8))
    _, hf_w, hf_ids = router(logits)
    assert torch.equal(hf_ids, ids) and torch.equal(hf_w, w.to(BF))  # routing_weight=rounded: HF's cast


def test_the_routers_without_renormalization_by_hand():
    """Qwen2-MoE (norm_topk_prob=False): softmax_all: the top k of the FP32 softmax, not renormalized;
    softmax_topk: exp(top-k logit - logsumexp) in FP32 with the logsumexp rounded to the logits' dtype
    (vLLM's compiled router stores that reduction in BF16, measured); softmax_topk_act: each of
    torch's ops on the BF16 logits (vLLM's eager router), whose logsumexp is not the rounded FP32 one.
    With renormalization, softmax_topk_act is the BF16 softmax of the top-k logits."""
    from engineprofiles.regions import route
    from engineprofiles.rounding import round_to

    g = torch.Generator().manual_seed(6)
    logits = (torch.randn(64, 8, generator=g) * 2).to(BF)
    p_all = MOE_SPEC.point(dict(gate_up=R, silu=R, expert_out=R, routing_weight=R, weighted=R, combine=F))
    w, ids = route(logits, 3, p_all, renormalize=False)
    top, want_ids = torch.softmax(logits.float(), -1).topk(3)
    assert torch.equal(ids, want_ids) and torch.equal(w, top)
    v, unsorted = torch.topk(logits, 3, sorted=False)
    lse = torch.logsumexp(logits.float(), -1, keepdim=True)
    w_top, ids_top = route(logits, 3, p_all.replace(router="softmax_topk"), renormalize=False)
    assert torch.equal(ids_top, unsorted)
    assert torch.equal(w_top, torch.exp(v.float() - round_to(lse, BF)))
    assert not torch.equal(w_top, torch.exp(v.float() - lse))  # the rounding of the logsumexp shows
    w_act, ids_act = route(logits, 3, p_all.replace(router="softmax_topk_act"), renormalize=False)
    assert torch.equal(ids_act, unsorted) and w_act.dtype == torch.float32
    by_hand = (v - torch.logsumexp(logits, -1, keepdim=True)).exp().float()
    assert torch.equal(w_act, by_hand)
    assert not torch.equal(w_act, w_top)
    assert not torch.equal(torch.logsumexp(logits, -1).float(), round_to(torch.logsumexp(logits.float(), -1), BF))
    w_act_n, _ = route(logits, 3, p_all.replace(router="softmax_topk_act"))
    assert torch.equal(w_act_n, torch.softmax(v, -1).float())
    # The act router's weights are already BF16: its routing_weight site is canonically rounded.
    assert MOE_SPEC.canonicalize(p_all.replace(router="softmax_topk_act", routing_weight=F))["routing_weight"] == R
