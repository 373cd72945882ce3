"""Train/inference mismatch metrics, as RL frameworks log them.

All take per-token log-probabilities of the sampled tokens under the engine (the sampler) and
under the trainer, as 1-D tensors of equal length (concatenate sequences; padding removed).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


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
