"""The model's own loss (``model(ids, labels=...)``) under torch.compile, as eager torch computes it.

HF's causal-LM loss is log-softmax and cross-entropy in FP32. Inductor compiles them with its own
reduction order, which moves the loss and the gradient of the logits by an ulp. So while a patch
is active, the causal LM's ``loss_function`` (HF's ``ForCausalLMLoss``, left unchanged when the
model has another one) runs, when torch.compile traces it, as one opaque custom op: the forward
is HF's function run eagerly, the backward is eager autograd of it (recomputed from the logits),
bit for bit what an eager step computes. Eagerly the loss is HF's function itself.
"""

from __future__ import annotations

from typing import Any

import torch

from ..ops._utils import autograd_in_op, owned


def _hf_loss():
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss


def _loss(logits, labels, shift_labels, vocab_size, ignore_index, n_tensor, n_int):
    n = n_tensor if n_tensor is not None else n_int
    return _hf_loss()(logits, labels, vocab_size, num_items_in_batch=n, ignore_index=ignore_index,
                      shift_labels=shift_labels)


@torch.library.custom_op("emulator::causal_lm_loss", mutates_args=())
def causal_lm_loss_op(logits: torch.Tensor, labels: torch.Tensor | None, shift_labels: torch.Tensor | None,
                      vocab_size: int, ignore_index: int, n_tensor: torch.Tensor | None,
                      n_int: int | None) -> torch.Tensor:
    return owned(_loss(logits, labels, shift_labels, vocab_size, ignore_index, n_tensor, n_int), logits)


@causal_lm_loss_op.register_fake
def _loss_fake(logits, labels, shift_labels, vocab_size, ignore_index, n_tensor, n_int):
    return logits.new_empty((), dtype=torch.float32)


@torch.library.custom_op("emulator::causal_lm_loss_bwd", mutates_args=())
def causal_lm_loss_bwd_op(logits: torch.Tensor, labels: torch.Tensor | None, shift_labels: torch.Tensor | None,
                          vocab_size: int, ignore_index: int, n_tensor: torch.Tensor | None, n_int: int | None,
                          grad: torch.Tensor) -> torch.Tensor:
    with autograd_in_op():
        lg = logits.detach().requires_grad_()
        loss = _loss(lg, labels, shift_labels, vocab_size, ignore_index, n_tensor, n_int)
        (d,) = torch.autograd.grad(loss, lg, grad)
    return owned(d, logits, grad)


@causal_lm_loss_bwd_op.register_fake
def _loss_bwd_fake(logits, labels, shift_labels, vocab_size, ignore_index, n_tensor, n_int, grad):
    return logits.new_empty(logits.shape)


def _setup(ctx, inputs, output):
    logits, labels, shift_labels, vocab_size, ignore_index, n_tensor, n_int = inputs
    ctx.save_for_backward(logits, labels, shift_labels, n_tensor)
    ctx.vocab_size, ctx.ignore_index, ctx.n_int = vocab_size, ignore_index, n_int


def _backward(ctx, grad):
    logits, labels, shift_labels, n_tensor = ctx.saved_tensors
    d = causal_lm_loss_bwd_op(logits, labels, shift_labels, ctx.vocab_size, ctx.ignore_index, n_tensor, ctx.n_int, grad)
    return d, None, None, None, None, None, None


causal_lm_loss_op.register_autograd(_backward, setup_context=_setup)


def is_hf_loss(fn: Any) -> bool:
    return fn is _hf_loss()


def loss_function():
    """The ``loss_function`` bound on a patched causal LM whose loss is HF's ``ForCausalLMLoss``."""

    def loss(logits, labels=None, vocab_size=None, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
             **kwargs):
        if not torch.compiler.is_compiling():
            return _hf_loss()(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                              ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        n_tensor = num_items_in_batch if isinstance(num_items_in_batch, torch.Tensor) else None
        n_int = int(num_items_in_batch) if num_items_in_batch is not None and n_tensor is None else None
        return causal_lm_loss_op(logits, labels, shift_labels, int(vocab_size), int(ignore_index), n_tensor, n_int)

    return loss
