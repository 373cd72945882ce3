"""TRL: the engine's rounding in GRPO training, and the mismatch metrics in TRL's logs.

Patch the family's class before the trainer builds its models, so that the policy and the reference
model TRL builds beside it (``from_pretrained`` or a deep copy) are both patched::

    import emulator
    emulator.patch_family("qwen2", "vllm")          # before GRPOTrainer(...) loads the model
    trainer = GRPOTrainer(model="path/to/checkpoint", ...)
    log_mismatch(trainer)                           # rollout_corr/* and mismatch/* in every log
    trainer.train()

:func:`log_mismatch` logs, once per generation batch, verl's train/inference mismatch metrics
(``rollout_corr/*``) and ``mismatch/*`` (:func:`engineprofiles.metrics.rollout_corr`) between the
log-probs the engine sampled with (TRL's ``sampling_per_token_logps``: vLLM's, or a ``rollout_func``'s
``"logprobs"``) and the trainer's log-probs of the same tokens (TRL's ``old_per_token_logps`` where TRL
computes them, else one no-grad forward of the policy, TRL's own function). They go where TRL's own
``sampling/*`` metrics go (averaged over the logging steps, every ``report_to`` backend). Tested with
TRL 1.13.0 (scripts/framework_env.sh trl 1.13.0); it reads TRL's generation output through
``GRPOTrainer._generate_and_score_completions``, which another TRL version may change: a trainer
without it is refused.

The metrics are per process (each rank's own rollouts); the main process's figures are the ones
printed. Tokens whose engine log-prob TRL holds as NaN (vLLM could not score them) are left out.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engineprofiles.extras import require
from engineprofiles.metrics import rollout_corr

require("insitu", "engineloop.integrations.trl")  # transformers: TrainerCallback
from transformers import TrainerCallback  # noqa: E402

__all__ = ["MismatchCallback", "log_mismatch", "TRLIntegrationError"]

_TRAINER_HOOK = "_generate_and_score_completions"


class TRLIntegrationError(RuntimeError):
    """The trainer cannot give the mismatch metrics (no engine log-probs, an unsupported TRL)."""


class MismatchCallback(TrainerCallback):
    """The callback :func:`log_mismatch` adds: it holds the last batch's metrics (``last``) and the number of
    batches measured (``batches``); :meth:`remove` stops the logging. It stays through every ``train()`` call."""

    def __init__(self, trainer: Any, is_level: str, is_threshold: float):
        self.trainer, self.is_level, self.is_threshold = trainer, is_level, is_threshold
        self.last: dict[str, float] = {}
        self.batches = 0

    def measure(self, output: dict[str, Any]) -> dict[str, float]:
        """The metrics of one generation batch (TRL's output dict); recorded into the trainer's metrics."""
        trainer = self.trainer
        engine = output.get("sampling_per_token_logps")
        if engine is None:
            raise TRLIntegrationError(
                "TRL handed no engine log-probs for this batch (sampling_per_token_logps): generate with vLLM "
                "(use_vllm=True) or a rollout_func that returns 'logprobs'")
        mask = output["completion_mask"].bool()
        if output.get("tool_mask") is not None:
            mask = mask & output["tool_mask"].bool()
        train = output.get("old_per_token_logps")
        if train is None:
            train = self._trainer_logps(output)
        mask = mask & ~torch.isnan(engine)
        if not bool(mask.any()):
            return {}
        metrics = rollout_corr(engine.detach().float(), train.detach().float(), mask,
                               is_level=self.is_level, is_threshold=self.is_threshold)
        mode = "train" if trainer.model.training else "eval"
        for name, value in metrics.items():
            trainer._metrics[mode][name].append(float(value))
        self.last, self.batches = metrics, self.batches + 1
        return metrics

    def _trainer_logps(self, output: dict[str, Any]) -> torch.Tensor:
        """The policy's log-probs of the completion tokens, as TRL computes ``old_per_token_logps``
        (its own function: the temperature applied, the prompt left-padded, no gradient)."""
        trainer = self.trainer
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        keep = output["completion_ids"].size(1)
        batch = (trainer.args.per_device_train_batch_size if trainer.model.training
                 else trainer.args.per_device_eval_batch_size)
        with torch.no_grad():
            logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention, keep, batch)
        return logps

    def remove(self) -> None:
        """Stop logging: the trainer's own generation step back, this callback out of its callbacks."""
        self.trainer.__dict__.pop(_TRAINER_HOOK, None)
        self.trainer.remove_callback(self)


def log_mismatch(trainer: Any, *, is_level: str = "token", is_threshold: float = 2.0) -> MismatchCallback:
    """Log ``rollout_corr/*`` and ``mismatch/*`` for every generation batch of a TRL ``GRPOTrainer``
    (see the module's docstring); returns the callback it added to the trainer. ``is_level`` and
    ``is_threshold`` are :func:`~engineprofiles.metrics.rollout_corr`'s. Refused
    (:class:`TRLIntegrationError`) where the trainer samples with the trained model itself (neither
    ``use_vllm`` nor a ``rollout_func``: no engine log-probs exist) or is not a GRPO trainer this TRL
    integration knows."""
    hook = getattr(type(trainer), _TRAINER_HOOK, None)
    if hook is None or not hasattr(trainer, "_metrics"):
        raise TRLIntegrationError(
            f"{type(trainer).__name__} has no {_TRAINER_HOOK} and _metrics: log_mismatch knows TRL's GRPOTrainer "
            "(tested with TRL 1.13.0); compute the metrics with engineprofiles.metrics.rollout_corr instead")
    if not getattr(trainer, "use_vllm", False) and getattr(trainer, "rollout_func", None) is None:
        raise TRLIntegrationError(
            "this trainer samples with the model it trains (use_vllm=False and no rollout_func), so there are no "
            "engine log-probs to compare with: sample with vLLM (use_vllm=True) or a rollout_func returning 'logprobs'")
    if _TRAINER_HOOK in trainer.__dict__:
        raise TRLIntegrationError("log_mismatch was already called on this trainer")
    callback = MismatchCallback(trainer, is_level, is_threshold)
    rollout_corr(torch.full((1,), -1.0), torch.full((1,), -1.0), is_level=is_level,
                 is_threshold=is_threshold)  # bad is_level / is_threshold: refused now, not at the first step
    original = getattr(trainer, _TRAINER_HOOK)

    @functools.wraps(original)
    def generate_and_score(*args: Any, **kwargs: Any) -> dict[str, Any]:
        output = original(*args, **kwargs)
        callback.measure(output)
        return output

    setattr(trainer, _TRAINER_HOOK, generate_and_score)
    trainer.add_callback(callback)
    return callback
