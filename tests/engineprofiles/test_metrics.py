import math

import pytest
import torch

from engineprofiles.metrics import k3, mismatch


def test_mismatch_against_hand_computed_values():
    le = torch.tensor([math.log(0.5), math.log(0.25)])
    lt = torch.tensor([math.log(0.5), math.log(0.5)])
    m = mismatch(le, lt)
    assert m.tokens == 2
    assert m.exact_match == 0.5
    # token 2: r = 0.5/0.25 = 2, k3 = (2 - 1) - ln 2
    assert m.k3_kl == pytest.approx((1 - math.log(2)) / 2, rel=1e-6)  # inputs are FP32 logs
    assert m.abs_dp_max == pytest.approx(0.25, rel=1e-6) and m.abs_dp_mean == pytest.approx(0.125, rel=1e-6)
    assert m.abs_dlogp_max == pytest.approx(math.log(2), rel=1e-6)
    assert m.abs_dlogp_mean == pytest.approx(math.log(2) / 2, rel=1e-6)
    # PPL ratio = exp(-mean lt) / exp(-mean le) = exp(mean le - mean lt) = exp(-ln2/2)
    assert m.ppl_ratio == pytest.approx(math.exp(-math.log(2) / 2), rel=1e-6)


def test_a_trainer_compared_with_itself_has_zero_mismatch():
    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(50, 100, generator=g), -1)[torch.arange(50), torch.randint(0, 100, (50,), generator=g)]
    m = mismatch(lp, lp.clone())
    assert m.exact_match == 1.0 and m.k3_kl == 0.0 and m.abs_dp_max == 0.0 and m.abs_dlogp_max == 0.0
    assert m.ppl_ratio == 1.0


def test_one_ulp_in_one_log_prob_breaks_exact_match_but_barely_moves_means():
    lp = torch.full((1000,), -2.0)
    other = lp.clone()
    other[3] = torch.nextafter(other[3], torch.tensor(0.0))
    m = mismatch(lp, other)
    assert m.exact_match == pytest.approx(0.999)
    assert 0 < m.abs_dlogp_mean < 1e-8


def test_k3_is_nonnegative():
    d = torch.linspace(-5, 5, 101)
    assert (k3(torch.zeros(101), d) >= 0).all()


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="equal length"):
        mismatch(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="no tokens"):
        mismatch(torch.zeros(0), torch.zeros(0))
