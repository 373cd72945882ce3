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


# -- rollout_corr: verl's metrics -----------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from engineprofiles.errors import EngineProfilesError, MetricsInputError  # noqa: E402
from engineprofiles.metrics import rollout_corr  # noqa: E402

A = math.log(2)
NAN = float("nan")
# Two sequences padded to 3 tokens; the padding holds NaN, which must never be read.
#   sequence 1: engine -a, -2a   trainer -a, -a     log r = logp_train - logp_engine = 0, a
#   sequence 2: engine -a        trainer -3a        log r = -2a
LE = torch.tensor([[-A, -2 * A, NAN], [-A, NAN, NAN]], dtype=torch.float64)
LT = torch.tensor([[-A, -A, NAN], [-3 * A, NAN, NAN]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_rollout_corr_against_hand_computed_values():
    m = rollout_corr(LE, LT, MASK)
    approx = lambda x: pytest.approx(x, rel=1e-12, abs=1e-15)  # noqa: E731
    # 3 tokens, log r = [0, a, -2a], r = [1, 2, 1/4]
    assert m["mismatch/tokens"] == 3 and m["mismatch/sequences"] == 2
    # kl: token mean of logp_engine - logp_train = -(0 + a - 2a) / 3 = a/3
    assert m["rollout_corr/kl"] == approx(A / 3)
    # k3: r - 1 - log r per token = 0, (2 - 1 - a), (1/4 - 1 + 2a); mean = (1/4 + a) / 3
    assert m["rollout_corr/k3_kl"] == approx((0.25 + A) / 3)
    # trainer's mean log-prob per sequence: -a, -3a -> perplexities 2, 8 -> sequence mean 5
    assert m["rollout_corr/training_ppl"] == approx(5.0)
    assert m["rollout_corr/training_log_ppl"] == approx((A + 3 * A) / 2)
    # engine's mean log-prob per sequence: -1.5a, -a -> perplexities 2**1.5, 2 -> mean sqrt(2) + 1
    assert m["rollout_corr/rollout_ppl"] == approx(math.sqrt(2) + 1)
    assert m["rollout_corr/rollout_log_ppl"] == approx((1.5 * A + A) / 2)
    # log_ppl_diff per sequence = engine mean - trainer mean = -1.5a + a, -a + 3a = -0.5a, 2a
    assert m["rollout_corr/log_ppl_diff"] == approx((-0.5 * A + 2 * A) / 2)
    assert m["rollout_corr/log_ppl_abs_diff"] == approx((0.5 * A + 2 * A) / 2)
    assert m["rollout_corr/log_ppl_diff_max"] == approx(2 * A)
    assert m["rollout_corr/log_ppl_diff_min"] == approx(-0.5 * A)
    # ppl_ratio: sequence mean of exp(log_ppl_diff) = (2**-0.5 + 2**2) / 2
    assert m["rollout_corr/ppl_ratio"] == approx((2 ** -0.5 + 4) / 2)
    # chi2_token: mean r**2 - 1 = (1 + 4 + 1/16) / 3 - 1 = 11/16
    assert m["rollout_corr/chi2_token"] == approx(11 / 16)
    # chi2_seq: prod r per sequence = 2, 1/4 -> mean of squares (4 + 1/16) / 2 - 1 = 33/32
    assert m["rollout_corr/chi2_seq"] == approx(33 / 32)
    # ESS (token level, threshold 2): w = clamp(r, 1/2, 2) = 1, 2, 1/2; mean 7/6, mean of squares
    # (1 + 4 + 1/4) / 3 = 7/4; ESS = (7/6)**2 / (7/4) = 7/9
    assert m["rollout_corr/rollout_is_eff_sample_size"] == approx(7 / 9)
    # exact match: only the first token's two log-probs are equal
    assert m["mismatch/exact_match"] == approx(1 / 3)
    # |log r| = 0, a, 2a
    assert m["mismatch/abs_dlogp_max"] == approx(2 * A) and m["mismatch/abs_dlogp_mean"] == approx(A)


def test_rollout_corr_sequence_level_ess_and_threshold():
    # Sequence weights prod r = 2 (2 tokens), 1/4 -> clamped to 1/2 (1 token); each sequence's
    # weight counts once per token: mean (2 + 2 + 1/2) / 3 = 3/2, squares (4 + 4 + 1/4) / 3 = 11/4;
    # ESS = (9/4) / (11/4) = 9/11
    m = rollout_corr(LE, LT, MASK, is_level="sequence")
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(9 / 11, rel=1e-12)
    # threshold 4: token weights 1, 2, 1/4 unclamped: mean 13/12, squares (1 + 4 + 1/16) / 3 = 27/16;
    # ESS = (169/144) / (27/16) = 169/243
    m = rollout_corr(LE, LT, MASK, is_threshold=4.0)
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(169 / 243, rel=1e-12)
    # the other metrics do not depend on the IS settings
    base = rollout_corr(LE, LT, MASK)
    assert {k: v for k, v in m.items() if "eff_sample" not in k} == {k: v for k, v in base.items()
                                                                      if "eff_sample" not in k}


def test_rollout_corr_1d_with_seq_lens_equals_the_padded_batch():
    le = torch.tensor([-A, -2 * A, -A], dtype=torch.float64)
    lt = torch.tensor([-A, -A, -3 * A], dtype=torch.float64)
    assert rollout_corr(le, lt, seq_lens=[2, 1]) == rollout_corr(LE, LT, MASK)
    assert rollout_corr(le, lt, seq_lens=torch.tensor([2, 1])) == rollout_corr(LE, LT, MASK)
    # a bool mask and a float 0/1 mask are the same mask
    assert rollout_corr(LE, LT, MASK.bool()) == rollout_corr(LE, LT, MASK.double())
    # without seq_lens, 1-D is one sequence: ppl over the pooled tokens' mean log-prob
    one = rollout_corr(le, lt)
    assert one["mismatch/sequences"] == 1
    assert one["rollout_corr/training_ppl"] == pytest.approx(2 ** (5 / 3), rel=1e-12)  # exp((a + a + 3a) / 3)


def test_an_all_padding_row_is_left_out_of_the_sequence_means():
    le = torch.cat([LE, torch.full((1, 3), -1.0, dtype=torch.float64)])
    lt = torch.cat([LT, torch.full((1, 3), -9.0, dtype=torch.float64)])
    mask = torch.cat([MASK, torch.zeros(1, 3, dtype=MASK.dtype)])
    assert rollout_corr(le, lt, mask) == rollout_corr(LE, LT, MASK)
    assert rollout_corr(LE[0, :2].clone(), LT[0, :2].clone(), seq_lens=[2, 0])["mismatch/sequences"] == 1


def test_low_precision_inputs_are_computed_in_float64_and_compared_in_their_common_dtype():
    le = torch.tensor([-0.5, -1.0], dtype=torch.bfloat16)
    lt = torch.tensor([-0.5, -1.0], dtype=torch.float32)
    m = rollout_corr(le, lt)
    assert m["mismatch/exact_match"] == 1.0 and m["rollout_corr/kl"] == 0.0
    lt = lt.clone()
    lt[1] = torch.nextafter(lt[1], torch.tensor(0.0))  # one FP32 ulp: not representable in BF16
    assert rollout_corr(le, lt)["mismatch/exact_match"] == 0.5


@pytest.mark.parametrize("call,words", [
    (lambda: rollout_corr(torch.zeros(3), torch.zeros(4)), "same tokens"),
    (lambda: rollout_corr(torch.zeros(2, 3), torch.zeros(3, 2)), "shape (2, 3), logp_train (3, 2)"),
    (lambda: rollout_corr(torch.zeros(0), torch.zeros(0)), "no tokens"),
    (lambda: rollout_corr(torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2)), "mask selects none"),
    (lambda: rollout_corr(torch.zeros(2, 2), torch.zeros(2, 2), torch.ones(2, 3)), "mask has shape (2, 3)"),
    (lambda: rollout_corr(torch.zeros(2, 2), torch.zeros(2, 2), torch.full((2, 2), 0.5)), "only 0 and 1"),
    (lambda: rollout_corr(torch.zeros(2), torch.zeros(2), torch.tensor([1, 2])), "found 2"),
    (lambda: rollout_corr(torch.zeros(2), torch.zeros(2), torch.ones(2, dtype=torch.complex64)), "complex64"),
    (lambda: rollout_corr(torch.zeros(2), torch.zeros(2), [1, 1]), "mask must be a torch.Tensor"),
    (lambda: rollout_corr(torch.tensor([0.0, NAN]), torch.zeros(2)), "NaN"),
    (lambda: rollout_corr(torch.zeros(2), torch.tensor([-float("inf"), 0.0])), "infinite"),
    (lambda: rollout_corr(torch.zeros(2), torch.tensor([2.3, 0.1])), "not losses"),
    (lambda: rollout_corr(torch.zeros(2, dtype=torch.long), torch.zeros(2)), "floating-point"),
    (lambda: rollout_corr([0.0], torch.zeros(1)), "must be a torch.Tensor"),
    (lambda: rollout_corr(torch.zeros(1, 1, 1), torch.zeros(1, 1, 1)), "1-D"),
    (lambda: rollout_corr(torch.zeros(3), torch.zeros(3), seq_lens=[1, 1]), "sum to 2"),
    (lambda: rollout_corr(torch.zeros(3), torch.zeros(3), seq_lens=[4, -1]), ">= 0"),
    (lambda: rollout_corr(torch.zeros(3), torch.zeros(3), seq_lens=[1.5, 1.5]), "must be ints"),
    (lambda: rollout_corr(torch.zeros(3), torch.zeros(3), seq_lens=torch.ones(3)), "integer tensor"),
    (lambda: rollout_corr(torch.zeros(1, 3), torch.zeros(1, 3), seq_lens=[3]), "seq_lens is for 1-D"),
    (lambda: rollout_corr(torch.zeros(3), torch.zeros(3), is_level="batch"), "is_level"),
    (lambda: rollout_corr(torch.zeros(3), torch.zeros(3), is_threshold=0.5), ">= 1"),
])
def test_rollout_corr_refuses_bad_input_with_a_typed_error(call, words):
    with pytest.raises(MetricsInputError) as e:
        call()
    assert words in str(e.value)
    assert isinstance(e.value, EngineProfilesError) and isinstance(e.value, ValueError)


def test_nan_under_the_mask_is_ignored_but_nan_in_a_token_is_not():
    assert rollout_corr(LE, LT, MASK)["mismatch/tokens"] == 3  # padding holds NaN
    with pytest.raises(MetricsInputError, match=r"logp_engine holds 1 NaN .* index \(0, 2\)"):
        rollout_corr(LE, LT, torch.tensor([[1, 1, 1], [1, 0, 0]]))


# -- properties -----------------------------------------------------------------------------------

logps = st.floats(min_value=-30.0, max_value=0.0, allow_nan=False)


@st.composite
def batches(draw):
    b, t = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    le = torch.tensor(draw(st.lists(logps, min_size=b * t, max_size=b * t)), dtype=torch.float64).view(b, t)
    lt = torch.tensor(draw(st.lists(logps, min_size=b * t, max_size=b * t)), dtype=torch.float64).view(b, t)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))).view(b, t)
    mask[draw(st.integers(0, b - 1)), draw(st.integers(0, t - 1))] = True  # at least one token
    return le, lt, mask


@settings(max_examples=60, deadline=None)
@given(batches())
def test_identical_log_probs_have_no_mismatch(batch):
    le, _, mask = batch
    m = rollout_corr(le, le.clone(), mask)
    assert m["rollout_corr/kl"] == 0.0 and m["rollout_corr/k3_kl"] == 0.0
    assert m["rollout_corr/ppl_ratio"] == 1.0 and m["rollout_corr/rollout_is_eff_sample_size"] == 1.0
    assert m["rollout_corr/chi2_token"] == 0.0 and m["rollout_corr/chi2_seq"] == 0.0
    assert m["rollout_corr/log_ppl_abs_diff"] == 0.0 and m["mismatch/abs_dlogp_max"] == 0.0
    assert m["mismatch/exact_match"] == 1.0
    assert m["rollout_corr/training_ppl"] == m["rollout_corr/rollout_ppl"]


@settings(max_examples=60, deadline=None)
@given(batches(), st.floats(min_value=-3.0, max_value=3.0))
def test_a_constant_shift_of_the_trainer_gives_the_closed_forms(batch, c):
    # logp_train = logp_engine + c on every token: log r = c everywhere (both stay <= 0).
    le, _, mask = batch
    le = le - 3.0
    m = rollout_corr(le, le + c, mask)
    tol = dict(rel=1e-9, abs=1e-12)
    assert m["rollout_corr/kl"] == pytest.approx(-c, **tol)
    assert m["rollout_corr/k3_kl"] == pytest.approx(math.expm1(c) - c, **tol)
    assert m["rollout_corr/ppl_ratio"] == pytest.approx(math.exp(-c), **tol)
    assert m["rollout_corr/log_ppl_abs_diff"] == pytest.approx(abs(c), **tol)
    assert m["rollout_corr/chi2_token"] == pytest.approx(math.expm1(2 * c), **tol)
    # every weight is the same: ESS 1 at token level, whatever the clamp does
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1.0, **tol)


@settings(max_examples=60, deadline=None)
@given(batches())
def test_ranges_and_that_padding_and_row_order_do_not_matter(batch):
    le, lt, mask = batch
    m = rollout_corr(le, lt, mask)
    assert m["rollout_corr/k3_kl"] >= 0.0
    assert 0.0 < m["rollout_corr/rollout_is_eff_sample_size"] <= 1.0 + 1e-12
    assert m["rollout_corr/log_ppl_abs_diff"] >= abs(m["rollout_corr/log_ppl_diff"]) - 1e-12
    assert 0.0 <= m["mismatch/exact_match"] <= 1.0
    garbage = torch.where(mask, le, torch.full_like(le, NAN)), torch.where(mask, lt, torch.full_like(lt, 5.0))
    assert rollout_corr(*garbage, mask) == m
    flipped = rollout_corr(le.flip(0), lt.flip(0), mask.flip(0))
    assert flipped == pytest.approx(m, rel=1e-12, abs=1e-12)
    # the same tokens concatenated, with the rows' lengths
    lens = mask.sum(1).tolist()
    flat = rollout_corr(le[mask], lt[mask], seq_lens=lens)
    assert flat == pytest.approx(m, rel=1e-12, abs=1e-12)
