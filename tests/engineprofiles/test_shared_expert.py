"""The MoE shared expert's reference (engineprofiles.regions.shared_expert): by hand, against HF's
own Qwen2-MoE block at its point, and its bad inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engineprofiles.regions import SHARED_EXPERT_SPEC, shared_block_ref, shared_expert_ref
from engineprofiles.rounding import round_to

BF = torch.bfloat16
R, FP = "rounded", "fp32"


def _inputs(t=40, h=64, i=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(BF)
    wgu = (torch.randn(2 * i, h, generator=g) / h ** 0.5).to(BF)
    wd = (torch.randn(h, i, generator=g) / i ** 0.5).to(BF)
    wg = (torch.randn(1, h, generator=g) / h ** 0.5).to(BF)
    routed = (torch.randn(t, h, generator=g) * 0.3).to(BF)
    res = (torch.randn(t, h, generator=g) * 0.5).to(BF)
    return x, wgu, wd, wg, routed, res


def _by_hand(x, wgu, wd, wg, routed, res, p):
    i = wd.shape[1]
    gu = F.linear(x, wgu)
    g, u = gu[:, :i].float(), gu[:, i:].float()
    s = F.silu(g)
    if p["silu"] == R:
        s = s.to(BF).float()
    y = F.linear((s * u).to(BF), wd).float()
    sg = torch.sigmoid(F.linear(x, wg).float())
    if p["gate"] == R:
        sg = sg.to(BF).float()
    t = sg * y
    if p["weighted"] == R:
        t = t.to(BF).float()
    m = routed.float() + t
    if p["sum"] == R:
        m = m.to(BF).float()
    return (m + res.float()).to(BF)


@pytest.mark.parametrize("p", [p for p in SHARED_EXPERT_SPEC.all_points() if p["silu_formula"] == "fused"],
                         ids=lambda p: p.label().replace(" ", ","))
def test_the_reference_is_the_computation_by_hand_at_every_point(p):
    inp = _inputs()
    assert torch.equal(shared_expert_ref(*inp, p), _by_hand(*inp, p))


def test_every_site_changes_the_stream_on_the_probe_like_inputs():
    """Each site, flipped alone, changes some outputs (else the probe could not see it)."""
    inp = _inputs(t=256)
    base = SHARED_EXPERT_SPEC.point(dict(silu=R, gate=R, weighted=R, sum=R))
    ref = shared_expert_ref(*inp, base)
    for s in SHARED_EXPERT_SPEC.site_names:
        other = shared_expert_ref(*inp, base.replace(**{s: FP}))
        assert not torch.equal(other, ref), s


def test_the_block_output_is_fp32_unless_the_sum_is_rounded():
    x, wgu, wd, wg, routed, res = _inputs()
    p = SHARED_EXPERT_SPEC.point(dict(silu=R, gate=R, weighted=R, sum=FP))
    m = shared_block_ref(x, wgu, wd, wg, routed, p)
    assert m.dtype == torch.float32 and not torch.equal(m, round_to(m, BF))
    mr = shared_block_ref(x, wgu, wd, wg, routed, p.replace(sum=R))
    assert torch.equal(mr, round_to(m, BF))


def test_hf_s_qwen2_moe_block_and_residual_add_are_the_all_rounded_point():
    """HF's Qwen2MoeSparseMoeBlock (routed experts standing in with a given output) then the decoder
    layer's residual add: bit for bit the point with every site rounded."""
    pytest.importorskip("transformers")
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    x, wgu, wd, wg, routed, res = _inputs(t=33, h=64, i=32, seed=3)
    cfg = Qwen2MoeConfig(hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=2,
                         num_experts_per_tok=1)
    block = Qwen2MoeSparseMoeBlock(cfg).to(BF)

    class Routed(torch.nn.Module):
        def forward(self, *a, **k):
            return routed

    block.experts = Routed()
    se = block.shared_expert
    with torch.no_grad():
        se.gate_proj.weight.copy_(wgu[:32])
        se.up_proj.weight.copy_(wgu[32:])
        se.down_proj.weight.copy_(wd)
        block.shared_expert_gate.weight.copy_(wg)
        out = res + block(x[None])[0]
    p = SHARED_EXPERT_SPEC.point(dict(silu=R, gate=R, weighted=R, sum=R))
    assert torch.equal(out, shared_expert_ref(x, wgu, wd, wg, routed, res, p))
    assert not torch.equal(out, shared_expert_ref(x, wgu, wd, wg, routed, res, p.replace(gate=FP)))


def test_bad_inputs_are_refused_with_the_shapes():
    x, wgu, wd, wg, routed, res = _inputs()
    p = SHARED_EXPERT_SPEC.point(dict(silu=R, gate=R, weighted=R, sum=R))
    with pytest.raises(ValueError, match="do not fit"):
        shared_expert_ref(x, wgu[:-1], wd, wg, routed, res, p)
    with pytest.raises(ValueError, match="w_gate"):
        shared_expert_ref(x, wgu, wd, wg[0], routed, res, p)
    with pytest.raises(ValueError, match="routed output"):
        shared_expert_ref(x, wgu, wd, wg, routed[:-1], res, p)
    with pytest.raises(ValueError, match="activation dtype"):
        shared_expert_ref(x, wgu, wd, wg, routed.float(), res, p)
    with pytest.raises(ValueError, match="residual"):
        shared_expert_ref(x, wgu, wd, wg, routed, res[:-1], p)
