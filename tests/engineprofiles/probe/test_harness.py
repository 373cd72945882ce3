"""The probe recovers every lattice point from synthetic engines built from the reference, and
flags planted ambiguity, shape dependence and nondeterminism."""

import pytest
import torch

from engineprofiles.probe.base import RegionImpl, Unavailable
from engineprofiles.probe.harness import bitwise_equal, run_probe
from engineprofiles.probe.inputs import SWEEP, cases, make_inputs
from engineprofiles.probe.synthetic import SyntheticAdapter
from engineprofiles.regions import ADD_SPEC, REGIONS, ROPE_SPEC, SWIGLU_SPEC

# Small shapes keep the full-lattice recovery fast; two shapes per region, one of them with a
# hidden size that is not a power of two.
SMALL = {
    "rope": [dict(tokens=5, q_heads=4, kv_heads=2, head_dim=64, style="neox", max_pos=40000),
             dict(tokens=3, q_heads=2, kv_heads=1, head_dim=128, style="interleaved", max_pos=100)],
    "swiglu": [dict(tokens=3, inter=1000), dict(tokens=1, inter=704)],
    "rmsnorm": [dict(tokens=5, hidden=1000), dict(tokens=2, hidden=896)],
    "add_rmsnorm": [dict(tokens=5, hidden=1000), dict(tokens=2, hidden=896)],
}


def _variant_label(spec, p):
    return " ".join(f"{k}={v}" for k, v in spec.variant_part(p).items())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("region", list(REGIONS))
def test_probe_recovers_every_lattice_point_of_a_synthetic_engine(region, dtype):
    spec = REGIONS[region]
    for p in spec.all_points():
        prof, _ = run_probe(SyntheticAdapter({region: p}, sweeps=SMALL), dtype=dtype, regions=[region])
        ev = prof.entry(region).evidence
        got = prof.point(region)
        assert spec.site_part(got) == spec.site_part(p), (p, got)
        # The variant is recovered, or reported as not told apart from the winner.
        assert got == p or _variant_label(spec, p) in ev.indistinguishable, (p, got, ev.indistinguishable)
        assert ev.match_rate == 1.0 and ev.max_ulp == 0
        assert not ev.ambiguous and not ev.shape_dependent and not ev.nondeterministic, (p, ev)
        assert ev.runner_up_match_rate is None or ev.runner_up_match_rate < 1.0


def test_probe_tells_apart_variants_that_differ_on_very_few_elements():
    # rstd=rsqrt and rstd=reciprocal_sqrt differ by one FP32 ULP on some rows; after rounding
    # to BF16 only a few output elements differ. The standard sweep must still find them.
    a = ADD_SPEC.point(variance_input="fp32", normalize_input="fp32", normalized="fp32", residual_out="rounded",
                       rstd="reciprocal_sqrt")
    prof, results = run_probe(SyntheticAdapter({"add_rmsnorm": a}), regions=["add_rmsnorm"])
    ev = prof.entry("add_rmsnorm").evidence
    assert prof.point("add_rmsnorm") == a
    assert ev.runner_up == a.replace(rstd="rsqrt").label()
    differing = ev.elements * (1 - ev.runner_up_match_rate)
    assert 0 < differing < 0.01 * ev.elements  # few elements tell them apart
    assert "rstd=rsqrt" not in ev.indistinguishable


def test_planted_ambiguity_is_flagged_not_resolved():
    a = SWIGLU_SPEC.point(silu="fp32")
    b = SWIGLU_SPEC.point(silu="rounded")
    prof, _ = run_probe(SyntheticAdapter({"swiglu": a}, mixed_with={"swiglu": b}, sweeps=SMALL), regions=["swiglu"])
    ev = prof.entry("swiglu").evidence
    assert ev.ambiguous
    assert ev.match_rate < 1.0
    tied_sites = {t.split(" ")[0] for t in ev.tied_with}
    assert {f"silu={prof.point('swiglu')['silu']}"} | tied_sites == {"silu=fp32", "silu=rounded"}


def test_planted_shape_dependence_is_flagged():
    small = ROPE_SPEC.point(cos_sin="rounded", products="rounded")
    large = ROPE_SPEC.point(cos_sin="fp32", products="fp32")
    prof, _ = run_probe(SyntheticAdapter({"rope": small}, large_points={"rope": large}, large_tokens=32), regions=["rope"])
    ev = prof.entry("rope").evidence
    assert ev.shape_dependent
    winners = {s.winner for s in ev.per_shape}
    assert small.label() in winners and large.label() in winners


def test_planted_nondeterminism_is_flagged():
    p = REGIONS["rmsnorm"].all_points()[0]
    prof, _ = run_probe(SyntheticAdapter({"rmsnorm": p}, flip_bits={"rmsnorm"}, sweeps=SMALL), regions=["rmsnorm"])
    assert prof.entry("rmsnorm").evidence.nondeterministic


def test_a_region_the_engine_cannot_run_is_recorded_unavailable_with_the_reason():
    class NoRope(SyntheticAdapter):
        def regions(self):
            r = super().regions()
            r["rope"] = Unavailable("no rotary kernel for this device")
            return r

    pts = {n: s.all_points()[0] for n, s in REGIONS.items()}
    prof, _ = run_probe(NoRope(pts, sweeps=SMALL))
    ev = prof.entry("rope").evidence
    assert ev.status == "unavailable" and "no rotary kernel" in ev.reason
    assert prof.available("swiglu")


def test_a_shape_the_engine_cannot_run_is_noted_and_the_rest_still_probed():
    p = SWIGLU_SPEC.point(silu="fp32")
    base = SyntheticAdapter({"swiglu": p}, sweeps=SMALL)
    inner = base.regions()["swiglu"].fn

    def picky(gate, up):
        if gate.shape[-1] == 704:
            raise Unavailable("hidden 704 not supported")
        return inner(gate, up)

    base.regions = lambda: {"swiglu": RegionImpl(picky, "picky")}
    prof, _ = run_probe(base, regions=["swiglu"])
    ev = prof.entry("swiglu").evidence
    assert prof.point("swiglu")["silu"] == "fp32"
    assert any("704" in n for n in ev.notes) and len(ev.shapes) == len(SMALL["swiglu"]) - 1


def test_probe_inputs_are_reproducible_and_contain_ties():
    for region in REGIONS:
        for case in cases(region):
            a, b = make_inputs(case, torch.bfloat16, 3), make_inputs(case, torch.bfloat16, 3)
            for k in a:
                if isinstance(a[k], torch.Tensor) and a[k].is_floating_point():
                    assert bitwise_equal(a[k], b[k]).all()
                elif isinstance(a[k], torch.Tensor):
                    assert torch.equal(a[k], b[k])
    case = cases("add_rmsnorm")[1]
    inp = make_inputs(case, torch.bfloat16, 0)
    s = inp["x"].float() + inp["residual"].float()
    assert (s != s.bfloat16().float()).any()  # sums that are not representable: ties and others


def test_standard_sweep_covers_token_counts_hidden_sizes_head_dims_and_gqa():
    tokens = {c["tokens"] for r in SWEEP.values() for c in r}
    assert 1 in tokens and max(tokens) >= 64
    hidden = {c["hidden"] for c in SWEEP["rmsnorm"]}
    assert any(h & (h - 1) for h in hidden) and any(not h & (h - 1) for h in hidden)
    assert {c["head_dim"] for c in SWEEP["rope"]} == {64, 128}
    assert any(c["q_heads"] != c["kv_heads"] for c in SWEEP["rope"])
    assert {c["style"] for c in SWEEP["rope"]} == {"neox", "interleaved"}
    assert max(c["max_pos"] for c in SWEEP["rope"]) > 32768


# -- the MoE experts (recorded beside the regions) ---------------------------------------------
MOE_SMALL = [dict(tokens=12, hidden=64, inter=32, experts=3, topk=2, one_hot=True),
             dict(tokens=9, hidden=96, inter=64, experts=4, topk=3),
             dict(tokens=24, hidden=64, inter=32, experts=4, topk=2, renormalize=False)]


def _moe_points():
    """The three points measured on real engines, and each with one site flipped."""
    from engineprofiles.regions import MOE_SPEC

    F, R = "fp32", "rounded"
    measured = [
        MOE_SPEC.point(dict(gate_up=F, silu=F, expert_out=F, routing_weight=F, weighted=F, combine=F),
                       dict(router="softmax_topk", gemm_order="sequential", combine_fma="fma")),  # vLLM compiled
        MOE_SPEC.point(dict(gate_up=F, silu=F, expert_out=F, routing_weight=R, weighted=F, combine=F),
                       dict(router="softmax_topk_act", gemm_order="sequential", combine_fma="fma")),  # vLLM eager
        MOE_SPEC.point(dict(gate_up=R, silu=R, expert_out=R, routing_weight=F, weighted=F, combine=F),
                       dict(gemm_order="library", combine_fma="none")),  # SGLang's native MoE
        MOE_SPEC.point(dict(gate_up=R, silu=R, expert_out=R, routing_weight=R, weighted=R, combine=F),
                       dict(gemm_order="library", combine_fma="none")),  # HF's grouped_mm experts
    ]
    out = []
    for p in measured:
        out.append(p)
        for site in MOE_SPEC.site_names:
            out.append(MOE_SPEC.canonicalize(p.replace(**{site: R if p[site] == F else F})))
    return list(dict.fromkeys(out))


@pytest.mark.parametrize("p", _moe_points(), ids=lambda p: p.label().replace(" ", ","))
def test_probe_recovers_the_moe_sites_of_a_synthetic_engine(p):
    from engineprofiles.regions import MOE_SPEC

    prof, _ = run_probe(SyntheticAdapter({"moe": p}, sweeps={"moe": MOE_SMALL}), regions=["moe"])
    ev = prof.moe.evidence
    got = prof.point("moe")
    assert MOE_SPEC.site_part(got) == MOE_SPEC.site_part(p), (p, got)
    assert got == p or _variant_label(MOE_SPEC, p) in ev.indistinguishable, (p, got, ev.indistinguishable)
    assert ev.match_rate == 1.0 and ev.max_ulp == 0 and not ev.ambiguous, ev
    assert ev.runner_up_match_rate is not None and ev.runner_up_match_rate < 1.0
    # The dense regions were not probed in this run, and say so.
    assert not prof.available("swiglu") and "--region" in prof.entry("swiglu").evidence.reason


def test_an_engine_without_moe_experts_records_them_unavailable_with_the_reason():
    prof, _ = run_probe(SyntheticAdapter({"swiglu": SWIGLU_SPEC.point(silu="fp32")}, sweeps=SMALL), regions=["swiglu", "moe"])
    assert not prof.available("moe") and prof.moe.evidence.reason == "synthetic has no MoE experts probe"


# -- the MoE shared expert (recorded beside the regions) ---------------------------------------
SHARED_SMALL = [dict(tokens=5, hidden=64, inter=32), dict(tokens=96, hidden=64, inter=32)]


def _shared_points():
    """The points measured on real engines (vLLM compiled and eager, HF), and each with one site flipped."""
    from engineprofiles.regions import SHARED_EXPERT_SPEC as S

    F, R = "fp32", "rounded"
    measured = [S.point(dict(silu=F, gate=R, weighted=R, sum=F)), S.point(dict(silu=R, gate=R, weighted=R, sum=R))]
    out = []
    for p in measured:
        out.append(p)
        out += [p.replace(**{s: R if p[s] == F else F}) for s in S.site_names]
    return list(dict.fromkeys(out))


@pytest.mark.parametrize("p", _shared_points(), ids=lambda p: p.label().replace(" ", ","))
def test_probe_recovers_the_shared_expert_sites_of_a_synthetic_engine(p):
    from engineprofiles.regions import SHARED_EXPERT_SPEC as S

    prof, _ = run_probe(SyntheticAdapter({"shared_expert": p}, sweeps={"shared_expert": SHARED_SMALL}),
                        regions=["shared_expert"])
    ev = prof.shared_expert.evidence
    got = prof.point("shared_expert")
    assert S.site_part(got) == S.site_part(p), (p, got)
    assert ev.match_rate == 1.0 and ev.max_ulp == 0 and not ev.ambiguous, ev
    assert ev.runner_up_match_rate is not None and ev.runner_up_match_rate < 1.0
    assert not prof.available("moe") and "--region" in prof.moe.evidence.reason


def test_an_engine_without_a_shared_expert_records_it_unavailable_with_the_reason():
    prof, _ = run_probe(SyntheticAdapter({"swiglu": SWIGLU_SPEC.point(silu="fp32")}, sweeps=SMALL),
                        regions=["swiglu", "shared_expert"])
    assert not prof.available("shared_expert")
    assert prof.shared_expert.evidence.reason == "synthetic has no MoE shared expert probe"


def test_every_probed_region_has_its_inputs_reference_and_engine_call_and_no_other_name_gets_anothers():
    """One entry per region in the probe's tables (inputs.MAKERS, harness.PROBES); an unknown name is
    refused by name (it once fell through to add_rmsnorm's inputs, reference and call)."""
    from engineprofiles.errors import EngineProfilesError
    from engineprofiles.probe.harness import PROBES, call_engine, reference_outputs
    from engineprofiles.probe.inputs import MAKERS, Case
    from engineprofiles.regions import BESIDE, REGIONS

    # attention is fitted by its own probe (engineprofiles/probe/attention.py), not through these tables
    assert set(MAKERS) == set(PROBES) == (set(REGIONS) | set(BESIDE)) - {"attention"}
    case = Case("gelu", dict(tokens=3, hidden=64))
    with pytest.raises(EngineProfilesError, match="no probe inputs for region 'gelu'"):
        make_inputs(case, torch.bfloat16, 0)
    inp = make_inputs(Case("add_rmsnorm", dict(tokens=3, hidden=64)), torch.bfloat16, 0)
    with pytest.raises(EngineProfilesError, match="no probe for region 'gelu'"):
        reference_outputs("gelu", REGIONS["add_rmsnorm"].all_points()[0], inp)
    with pytest.raises(EngineProfilesError, match="no probe for region 'gelu'"):
        call_engine("gelu", None, inp, "cpu")


def test_what_the_engine_picked_to_run_attention_is_recorded_in_the_profile():
    # vLLM's adapter records the attention kernel's ISA (vec, amx, ...) beside the machine: exact mode's
    # engine kernels run only where this machine picks the same one (a profile that records none refuses)
    class WithAttention(SyntheticAdapter):
        def attention(self):
            def sdpa(q, k, v, *, scale):
                qh, kh, vh = (t.transpose(0, 1).float() for t in (q, k, v))
                kh, vh = (t.repeat_interleave(qh.shape[0] // t.shape[0], 0) for t in (kh, vh))
                s = (qh @ kh.transpose(1, 2)) * scale
                tq, tk = s.shape[-2:]
                s = s.masked_fill(torch.ones(tq, tk, dtype=torch.bool).triu(tk - tq + 1), float("-inf"))
                return (s.softmax(-1) @ vh).transpose(0, 1).to(q.dtype)

            return RegionImpl(sdpa, "synthetic attention", settings={"attention_isa": "vec"})

    pts = {n: s.all_points()[0] for n, s in REGIONS.items()}
    prof, _ = run_probe(WithAttention(pts, sweeps=SMALL), regions=["attention"], quick=True)
    assert prof.engine.settings["attention_isa"] == "vec"
    assert prof.entry("attention").evidence.status == "measured"
    prof, _ = run_probe(SyntheticAdapter(pts, sweeps=SMALL), regions=["swiglu"])
    assert "attention_isa" not in prof.engine.settings  # attention not probed: nothing recorded of it
