"""Train/inference mismatch metrics, as RL frameworks log them.

All take per-token log-probabilities of the sampled tokens under the engine (the sampler) and
under the trainer. :func:`mismatch` takes 1-D tensors of equal length (concatenate sequences;
padding removed); :func:`rollout_corr` takes a padded ``[batch, seq]`` batch with its mask, or 1-D
tensors with the sequences' lengths, and returns verl's ``rollout_corr/*`` metrics as a dict of
floats (the monitor to call in a training loop; docs/monitoring.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Optional, Union

import torch

from .errors import MetricsInputError


@dataclass(frozen=True)
class Mismatch:
    tokens: int
    exact_match: float  # fraction of tokens whose log-probs are bitwise equal (as FP32)
    k3_kl: float  # mean k3 estimator of KL(engine || trainer) on the engine's samples
    abs_dp_max: float  # max |p_train - p_engine|
    abs_dp_mean: float
    abs_dlogp_mean: float  # mean |logp_train - logp_engine|
    abs_dlogp_max: float
    ppl_ratio: float  # trainer perplexity / engine perplexity on the sampled tokens

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def k3(logp_engine: torch.Tensor, logp_train: torch.Tensor) -> torch.Tensor:
    """Per-token k3 = (r - 1) - log r with r = p_train / p_engine (samples from the engine).

    Non-negative and unbiased for KL(engine || trainer) (Schulman's k3)."""
    log_r = logp_train.double() - logp_engine.double()
    return torch.expm1(log_r) - log_r


def mismatch(logp_engine: torch.Tensor, logp_train: torch.Tensor) -> Mismatch:
    if logp_engine.shape != logp_train.shape or logp_engine.dim() != 1:
        raise ValueError(
            f"need two 1-D tensors of equal length, got {tuple(logp_engine.shape)} and {tuple(logp_train.shape)}"
        )
    if logp_engine.numel() == 0:
        raise ValueError("no tokens to compare")
    le, lt = logp_engine.double(), logp_train.double()
    exact = (logp_engine.float() == logp_train.float()).double().mean()
    dp = (lt.exp() - le.exp()).abs()
    dl = (lt - le).abs()
    ppl_ratio = torch.exp(-(lt.mean() - le.mean()))
    return Mismatch(
        tokens=int(le.numel()),
        exact_match=float(exact),
        k3_kl=float(k3(le, lt).mean()),
        abs_dp_max=float(dp.max()),
        abs_dp_mean=float(dp.mean()),
        abs_dlogp_mean=float(dl.mean()),
        abs_dlogp_max=float(dl.max()),
        ppl_ratio=float(ppl_ratio),
    )


# -- verl's rollout_corr metrics --------------------------------------------------------------------

# verl clamps log importance ratios to [-20, 20] before exponentiating them (chi-squared, IS weights).
SAFETY_BOUND = 20.0
IS_LEVELS = ("token", "sequence")
# A log-probability is <= 0; engines and trainers compute log_softmax in FP32, which never rounds
# above 0, but leave room for a reduction that does. Larger values are losses or probabilities.
POSITIVE_TOLERANCE = 1e-4


def _check_logp(t: object, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise MetricsInputError(f"{what} must be a torch.Tensor of log-probs; got {type(t).__name__}")
    if not t.is_floating_point():
        raise MetricsInputError(f"{what} must be a floating-point tensor of log-probs; got dtype {t.dtype}")
    if t.dim() not in (1, 2):
        raise MetricsInputError(
            f"{what} must be 1-D (tokens; pass seq_lens to split sequences) or 2-D [batch, seq] with a mask; "
            f"got shape {tuple(t.shape)}")
    return t


def _check_mask(mask: object, shape: torch.Size, device: torch.device) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise MetricsInputError(f"mask must be a torch.Tensor (bool, or 0/1 integers or floats); got {type(mask).__name__}")
    if mask.shape != shape:
        raise MetricsInputError(f"mask has shape {tuple(mask.shape)}, the log-probs {tuple(shape)}: give one mask "
                                "entry per log-prob (1 = a sampled token to compare, 0 = padding)")
    if mask.device != device:
        raise MetricsInputError(f"mask is on {mask.device}, the log-probs on {device}; move them to one device")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise MetricsInputError(f"mask must be bool, or integers or floats that are 0 or 1; got dtype {mask.dtype}")
    bad = ~((mask == 0) | (mask == 1))
    if bool(bad.any()):
        v = mask[bad][0].item()
        raise MetricsInputError(f"mask must hold only 0 and 1 (or be bool); found {v!r} at {_where(bad)}: a weighted "
                                "mask is not a mask")
    return mask != 0


def _where(flags: torch.Tensor) -> str:
    idx, n = flags.nonzero()[0].tolist(), int(flags.sum())
    return f"index {tuple(idx) if len(idx) > 1 else idx[0]} ({n} such entr{'y' if n == 1 else 'ies'})"


def _segments(n: int, seq_lens: object, device: torch.device) -> tuple[int, torch.Tensor]:
    """The number of sequences, and the sequence index of each of ``n`` concatenated tokens."""
    if isinstance(seq_lens, torch.Tensor):
        if seq_lens.dim() != 1 or seq_lens.is_floating_point() or seq_lens.is_complex() or seq_lens.dtype == torch.bool:
            raise MetricsInputError(f"seq_lens must be a 1-D integer tensor or a list of ints; got a tensor of dtype "
                                    f"{seq_lens.dtype} and shape {tuple(seq_lens.shape)}")
        lens = [int(x) for x in seq_lens.tolist()]
    elif isinstance(seq_lens, Sequence) and not isinstance(seq_lens, (str, bytes)):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in seq_lens):
            raise MetricsInputError(f"seq_lens must be ints (the length of each sequence); got {list(seq_lens)!r}")
        lens = list(seq_lens)
    else:
        raise MetricsInputError(f"seq_lens must be a list of ints or a 1-D integer tensor; got {type(seq_lens).__name__}")
    if not lens:
        raise MetricsInputError("seq_lens is empty: give the length of each sequence")
    if any(x < 0 for x in lens):
        raise MetricsInputError(f"seq_lens must be >= 0; got {lens}")
    if sum(lens) != n:
        raise MetricsInputError(f"seq_lens sum to {sum(lens)}, but there are {n} log-probs: the lengths of the "
                                "concatenated sequences must add up to the number of tokens")
    return len(lens), torch.repeat_interleave(torch.arange(len(lens), device=device),
                                              torch.tensor(lens, dtype=torch.long, device=device))


def rollout_corr(
    logp_engine: torch.Tensor,
    logp_train: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    *,
    seq_lens: Union[Sequence[int], torch.Tensor, None] = None,
    is_level: str = "token",
    is_threshold: float = 2.0,
) -> dict[str, float]:
    """verl's train/inference mismatch metrics (``rollout_corr/*``) for one batch, as plain floats.

    ``logp_engine``: the log-prob of each sampled token under the engine that sampled it (vLLM's,
    SGLang's ``logprobs``); ``logp_train``: the same tokens' log-probs recomputed by the trainer
    (verl's ``old_log_prob``). Either a padded batch ``[batch, seq]`` with ``mask`` (bool or 0/1:
    1 = a response token; default: every position) whose rows are the sequences, or 1-D tensors of
    the concatenated tokens with ``seq_lens`` (default: one sequence) and an optional 1-D mask.
    Positions the mask leaves out are never read (padding may hold anything, NaN too). Computed in
    float64. Bad input raises :class:`~engineprofiles.errors.MetricsInputError`.

    What verl logs under each name (verl/trainer/ppo/rollout_corr_helper.py,
    ``compute_offpolicy_metrics`` and ``compute_is_metrics``), with ``r = p_train / p_engine`` per
    token, the log ratio ``log r = logp_train - logp_engine``, means over the unmasked tokens of
    the whole batch ("token mean") or over the sequences ("sequence mean"):

    - ``kl``: KL(engine || trainer) by the direct estimator: token mean of
      ``logp_engine - logp_train`` (can be negative on a finite sample).
    - ``k3_kl``: the same KL by Schulman's k3 estimator: token mean of ``r - 1 - log r`` (>= 0).
    - ``training_ppl`` / ``rollout_ppl``: each sequence's perplexity, ``exp(-mean of its
      log-probs)``, then the sequence mean (not the perplexity of the pooled tokens);
      ``training_log_ppl`` / ``rollout_log_ppl``: the sequence mean of ``-mean log-prob``.
    - ``log_ppl_diff``: per sequence, the engine's mean log-prob minus the trainer's (= log of
      that sequence's training/rollout perplexity ratio), sequence mean; ``log_ppl_abs_diff`` the
      sequence mean of its absolute value; ``log_ppl_diff_max`` / ``_min`` its extremes.
    - ``ppl_ratio``: sequence mean of ``exp(log_ppl_diff)``, i.e. of each sequence's training
      perplexity over its rollout perplexity (> 1: the trainer finds the samples less likely).
    - ``chi2_token``: chi-squared divergence of the trainer from the engine per token:
      ``token mean of r**2 - 1``, with ``log r`` clamped to [-20, 20].
    - ``chi2_seq``: the same per sequence: ``sequence mean of (prod r)**2 - 1``, the sum of the
      sequence's ``log r`` clamped to [-20, 20].
    - ``rollout_is_eff_sample_size``: the effective sample size of the truncated importance
      weights, normalised to (0, 1]: ``mean(w)**2 / mean(w**2)`` over the tokens, with
      ``w = r`` per token (``is_level="token"``) or ``w = prod r`` of the token's sequence
      (``"sequence"``: each sequence counts once per token) and ``w`` clamped to
      ``[1/is_threshold, is_threshold]`` (verl's ``rollout_is_threshold``, default 2). verl logs
      it only when IS weights are on (``rollout_is``); the other metrics always.

    Besides verl's, under ``mismatch/``: ``exact_match`` (fraction of tokens whose two log-probs
    are equal, compared in the wider of the two dtypes), ``abs_dlogp_max`` and ``abs_dlogp_mean``
    (of ``|logp_train - logp_engine|``), ``tokens`` and ``sequences`` (counted).

    Where this differs from verl on purpose: a sequence with no unmasked token (an all-padding
    row, a zero in ``seq_lens``) is left out of the sequence means (verl divides by its zero
    token count); the ESS is not offset by verl's 1e-8; ``is_threshold`` must be >= 1.
    """
    le, lt, valid, seg, n_seq = _checked(logp_engine, logp_train, mask, seq_lens, is_level, is_threshold)
    return _metrics(le, lt, valid, seg, n_seq, is_level, is_threshold)


def _checked(logp_engine, logp_train, mask, seq_lens, is_level: str, is_threshold: float):
    """rollout_corr's input checked (MetricsInputError naming what is wrong): the two log-prob tensors,
    the mask of the tokens to compare, each token's sequence index and the number of sequences."""
    le = _check_logp(logp_engine, "logp_engine")
    lt = _check_logp(logp_train, "logp_train")
    if le.shape != lt.shape:
        raise MetricsInputError(f"logp_engine has shape {tuple(le.shape)}, logp_train {tuple(lt.shape)}: give the "
                                "log-probs of the same tokens, in the same layout")
    if le.device != lt.device:
        raise MetricsInputError(f"logp_engine is on {le.device}, logp_train on {lt.device}; move them to one device")
    if is_level not in IS_LEVELS:
        raise MetricsInputError(f"is_level must be one of {', '.join(IS_LEVELS)} (verl's rollout_is); got {is_level!r}")
    if isinstance(is_threshold, bool) or not isinstance(is_threshold, (int, float)) or not is_threshold >= 1 \
            or is_threshold == float("inf"):
        raise MetricsInputError(f"is_threshold must be a finite number >= 1 (weights are clamped to "
                                f"[1/is_threshold, is_threshold]); got {is_threshold!r}")
    if le.numel() == 0:
        raise MetricsInputError(f"no tokens to compare: the log-probs have shape {tuple(le.shape)}")
    valid = (torch.ones(le.shape, dtype=torch.bool, device=le.device) if mask is None
             else _check_mask(mask, le.shape, le.device))
    if le.dim() == 2:
        if seq_lens is not None:
            raise MetricsInputError("seq_lens is for 1-D log-probs; a 2-D batch has one sequence per row (mark "
                                    "padding with the mask)")
        n_seq = le.shape[0]
        seg = torch.arange(n_seq, device=le.device).unsqueeze(1).expand(le.shape)
    else:
        if seq_lens is None:
            n_seq, seg = 1, torch.zeros(le.shape, dtype=torch.long, device=le.device)
        else:
            n_seq, seg = _segments(le.numel(), seq_lens, le.device)
    if not bool(valid.any()):
        raise MetricsInputError("no tokens to compare: the mask selects none (1 marks a response token)")
    for t, what in ((le, "logp_engine"), (lt, "logp_train")):
        v = t[valid]
        bad = ~torch.isfinite(v)
        if bool(bad.any()):
            kind = "NaN" if bool(torch.isnan(v).any()) else "infinite"
            raise MetricsInputError(f"{what} holds {int(bad.sum())} {kind} log-prob(s) at unmasked positions (first at "
                                    f"{_where(~torch.isfinite(t) & valid)}); mask them out or fix their source")
        if bool((v > POSITIVE_TOLERANCE).any()):
            raise MetricsInputError(f"{what} holds values above 0 (largest {float(v.max()):.6g} at "
                                    f"{_where((t > POSITIVE_TOLERANCE) & valid)}); log-probs are <= 0: pass "
                                    "log-probabilities, not losses (negative log-likelihoods) or probabilities")
    return le, lt, valid, seg, n_seq


def _metrics(le: torch.Tensor, lt: torch.Tensor, valid: torch.Tensor, seg: torch.Tensor, n_seq: int, is_level: str,
             is_threshold: float) -> dict[str, float]:
    """The metrics of :func:`rollout_corr` over the ``valid`` tokens (float64)."""
    common = torch.promote_types(le.dtype, lt.dtype)
    exact = (le[valid].to(common) == lt[valid].to(common)).double().mean()
    e, t, s = le[valid].double(), lt[valid].double(), seg[valid]
    n_tok = e.numel()
    log_r = t - e

    def per_seq(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n_seq, dtype=torch.float64, device=x.device).index_add_(0, s, x)

    count = per_seq(torch.ones_like(e))
    keep = count > 0
    count = count[keep]
    mean_e = per_seq(e)[keep] / count
    mean_t = per_seq(t)[keep] / count
    sum_log_r = per_seq(log_r)[keep]
    log_ppl_diff = mean_e - mean_t

    if is_level == "token":
        w = log_r.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    else:
        w = sum_log_r.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp().repeat_interleave(count.long())
    w = w.clamp(1.0 / is_threshold, float(is_threshold))
    ess = w.mean().square() / w.square().mean()

    out = {
        "rollout_corr/kl": (e - t).mean(),
        "rollout_corr/k3_kl": (torch.expm1(log_r) - log_r).mean(),
        "rollout_corr/training_ppl": torch.exp(-mean_t).mean(),
        "rollout_corr/training_log_ppl": (-mean_t).mean(),
        "rollout_corr/rollout_ppl": torch.exp(-mean_e).mean(),
        "rollout_corr/rollout_log_ppl": (-mean_e).mean(),
        "rollout_corr/log_ppl_diff": log_ppl_diff.mean(),
        "rollout_corr/log_ppl_abs_diff": log_ppl_diff.abs().mean(),
        "rollout_corr/log_ppl_diff_max": log_ppl_diff.max(),
        "rollout_corr/log_ppl_diff_min": log_ppl_diff.min(),
        "rollout_corr/ppl_ratio": torch.exp(log_ppl_diff).mean(),
        "rollout_corr/chi2_token": (2 * log_r.clamp(-SAFETY_BOUND, SAFETY_BOUND)).exp().mean() - 1.0,
        "rollout_corr/chi2_seq": (2 * sum_log_r.clamp(-SAFETY_BOUND, SAFETY_BOUND)).exp().mean() - 1.0,
        "rollout_corr/rollout_is_eff_sample_size": ess,
        "mismatch/exact_match": exact,
        "mismatch/abs_dlogp_max": log_r.abs().max(),
        "mismatch/abs_dlogp_mean": log_r.abs().mean(),
        "mismatch/tokens": n_tok,
        "mismatch/sequences": int(keep.sum()),
    }
    return {k: float(v) for k, v in out.items()}
