"""The HF code around the regions, as opaque custom ops when torch.compile traces a patched model.

Inductor compiles the code it traces with its own reductions (a sum over rows in another order
than ATen's cascade), its own transcendental functions and its own scatter-adds, so code that
eager torch computes with such kernels moves by an ulp when compiled, and the patched model would
no longer be bit-equal to its eager self. Measured on CPU (tests/emulator/test_compile.py): the
FP32 cos/sin of RoPE, the gradient of the token embedding (a scatter-add over repeated tokens),
the gradient of a linear layer's bias (a sum over rows), HF's attention function (its softmax, and
repeat_kv's gradient, a sum over the grouped heads) and the causal LM's loss (log-softmax and
cross-entropy). The patched forwards call these ops instead while torch.compile traces; each op
runs exactly eager torch's code:

* forward: the same torch function, run eagerly inside the op;
* backward: the ATen kernel eager autograd calls (the embedding), or eager autograd of the
  function recomputed from the saved inputs (attention, biased linear, loss: one more forward
  of that piece in the backward), which gives the bits eager autograd gives, as every kernel
  involved is deterministic.

Eagerly (not compiling) none of this runs: the forwards call HF's modules as before.
Matmuls without bias stay in the compiled graph: Inductor calls ATen's matmul for them, with the
layouts eager autograd uses, and they are bit-equal there (tests/emulator/test_compile.py).
"""

from __future__ import annotations

import types
from typing import Any

import torch

from engineprofiles.regions import RopeFrequencies

from ..errors import CompileUnsupported
from ..ops._utils import autograd_in_op, owned


def check_compile_settings() -> None:
    """Run by these ops' fake implementations, i.e. while torch.compile traces a patched model (also
    inside Inductor, under the options given to torch.compile): Inductor must round like eager."""
    import torch._inductor.config as inductor_config

    if not inductor_config.emulate_precision_casts:
        raise CompileUnsupported(
            "a patched model is being compiled with torch._inductor.config.emulate_precision_casts off (apply_profile "
            "turns it on while a patch is active; torch.compile's options or a later change turned it off): Inductor "
            "would then keep BF16 intermediates in FP32 where eager torch rounds them (e.g. the sum of an "
            "activation's gradients), and the compiled model would not be bit-equal to the eager patched model. "
            "Leave it on (do not pass options={'emulate_precision_casts': False})"
        )


# -- RoPE's FP32 cos/sin ---------------------------------------------------------------------------


@torch.library.custom_op("emulator::rope_cos_sin", mutates_args=())
def rope_cos_sin_op(positions: torch.Tensor, rotary_dim: int, theta: float, rope_type: str, factor: float,
                    low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int, linear_scales: str, beta_fast: float, beta_slow: float,
                    mscale: float, truncate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """RopeFrequencies(...).cos_sin(positions); its fields as arguments (RopeFrequencies.args())."""
    cos, sin = RopeFrequencies(rotary_dim, theta, rope_type, factor, low_freq_factor, high_freq_factor,
                               original_max_position_embeddings, linear_scales, beta_fast, beta_slow, mscale,
                               truncate).cos_sin(positions)
    return owned(cos, positions), owned(sin, positions)


@rope_cos_sin_op.register_fake
def _rope_cos_sin_fake(positions, rotary_dim, *_):
    check_compile_settings()
    shape = (*positions.shape, rotary_dim // 2)
    return positions.new_empty(shape, dtype=torch.float32), positions.new_empty(shape, dtype=torch.float32)


# -- the token embedding ---------------------------------------------------------------------------


@torch.library.custom_op("emulator::embedding", mutates_args=())
def embedding_op(weight: torch.Tensor, ids: torch.Tensor, padding_idx: int) -> torch.Tensor:
    return owned(torch.nn.functional.embedding(ids, weight, padding_idx if padding_idx >= 0 else None), weight)


@embedding_op.register_fake
def _embedding_fake(weight, ids, padding_idx):
    check_compile_settings()
    return weight.new_empty((*ids.shape, weight.shape[1]))


@torch.library.custom_op("emulator::embedding_bwd", mutates_args=())
def embedding_bwd_op(grad: torch.Tensor, ids: torch.Tensor, num_weights: int, padding_idx: int) -> torch.Tensor:
    # What eager autograd's EmbeddingBackward calls (dense, no scaling by frequency).
    return owned(torch.ops.aten.embedding_backward(grad, ids, num_weights, padding_idx, False, False), grad)


@embedding_bwd_op.register_fake
def _embedding_bwd_fake(grad, ids, num_weights, padding_idx):
    return grad.new_empty((num_weights, grad.shape[-1]))


def _embedding_setup(ctx, inputs, output):
    weight, ids, padding_idx = inputs
    ctx.save_for_backward(ids)
    ctx.num_weights, ctx.padding_idx = weight.shape[0], padding_idx


def _embedding_backward(ctx, grad):
    (ids,) = ctx.saved_tensors
    return embedding_bwd_op(grad, ids, ctx.num_weights, ctx.padding_idx), None, None


embedding_op.register_autograd(_embedding_backward, setup_context=_embedding_setup)


def embedding(module: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``module(ids)`` (an nn.Embedding) as the opaque op; the caller checks that the module is a
    plain dense embedding (no max_norm, sparse or scale_grad_by_freq)."""
    pad = module.padding_idx
    return embedding_op(module.weight, ids, -1 if pad is None else int(pad))


class _GatherEmbedding(torch.autograd.Function):
    """The embedding's gather traced inline (Inductor fuses the row loads into its consumers, as an
    engine's compiled graph does), its gradient the opaque op's (eager's, not Inductor's scatter-add)."""

    @staticmethod
    def forward(ctx, weight, ids, padding_idx: int):
        ctx.save_for_backward(ids)
        ctx.num_weights, ctx.padding_idx = weight.shape[0], padding_idx
        return torch.nn.functional.embedding(ids, weight, padding_idx if padding_idx >= 0 else None)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        return embedding_bwd_op(grad, ids, ctx.num_weights, ctx.padding_idx), None, None


def gather_embedding(module: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``module(ids)`` with the gather inline for Inductor and eager's gradient (see _GatherEmbedding)."""
    pad = module.padding_idx
    return _GatherEmbedding.apply(module.weight, ids, -1 if pad is None else int(pad))


def plain_embedding(module: Any) -> bool:
    return (type(module) is torch.nn.Embedding and module.max_norm is None and not module.sparse
            and not module.scale_grad_by_freq)


# -- a linear layer with a bias --------------------------------------------------------------------


@torch.library.custom_op("emulator::linear", mutates_args=())
def linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return owned(torch.nn.functional.linear(x, weight, bias), x, weight, bias)


@linear_op.register_fake
def _linear_fake(x, weight, bias):
    check_compile_settings()
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("emulator::linear_bwd", mutates_args=())
def linear_bwd_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, grad: torch.Tensor,
                  need: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias) by eager autograd of F.linear; an empty tensor where ``need`` says no."""
    with autograd_in_op():
        ins = [t.detach().requires_grad_(n) for t, n in zip((x, weight, bias), need)]
        y = torch.nn.functional.linear(*ins)
        wrt = [t for t in ins if t.requires_grad]
        grads = iter(torch.autograd.grad(y, wrt, grad))
    return tuple(owned(next(grads), x, weight, bias, grad) if n else t.new_empty(0)  # type: ignore[return-value]
                 for t, n in zip((x, weight, bias), need))


@linear_bwd_op.register_fake
def _linear_bwd_fake(x, weight, bias, grad, need):
    return tuple(t.new_empty(t.shape) if n else t.new_empty(0) for t, n in zip((x, weight, bias), need))


def _linear_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _linear_backward(ctx, grad):
    need = [bool(n) for n in ctx.needs_input_grad[:3]]
    grads = linear_bwd_op(*ctx.saved_tensors, grad, need)
    return tuple(g if n else None for g, n in zip(grads, need))


linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)


def linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``; while torch.compile traces, a plain nn.Linear whose bias gets a gradient is
    the opaque op (other modules, e.g. PEFT's LoRA layers, are called as they are)."""
    if (torch.compiler.is_compiling() and type(module) is torch.nn.Linear and module.bias is not None
            and module.bias.requires_grad):
        w, b = module.weight, module.bias
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            # Autocast does not reach inside a custom op: cast as it casts F.linear (every operand to its
            # dtype), outside, so that the casts' gradients take the FP32 master weights' dtype back.
            dt = torch.get_autocast_dtype(dev)
            x, w, b = x.to(dt), w.to(dt), b.to(dt)
        return linear_op(x, w, b)
    return module(x)


# -- HF's attention function ------------------------------------------------------------------------
# The function is named by the attention implementation ("sdpa", "eager": the family's
# eager_attention_forward); the module it reads is rebuilt from the attributes those read.

ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")


def _attention_function(impl: str, family: str):
    if impl == "eager":
        from .families import FAMILIES

        return FAMILIES[family].classes()["eager_attention"]
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[impl]


def _attention(q, k, v, mask, impl, family, groups, is_causal, scaling):
    module = types.SimpleNamespace(num_key_value_groups=groups, is_causal=is_causal, training=False)
    out, _ = _attention_function(impl, family)(module, q, k, v, mask, dropout=0.0, scaling=scaling)
    return out


@torch.library.custom_op("emulator::hf_attention", mutates_args=())
def hf_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, impl: str,
                    family: str, groups: int, is_causal: bool, scaling: float) -> torch.Tensor:
    return owned(_attention(q, k, v, mask, impl, family, groups, is_causal, scaling), q, k, v, mask)


@hf_attention_op.register_fake
def _hf_attention_fake(q, k, v, mask, impl, family, groups, is_causal, scaling):
    check_compile_settings()
    b, h, t, _ = q.shape
    return q.new_empty((b, t, h, v.shape[-1]))


@torch.library.custom_op("emulator::hf_attention_bwd", mutates_args=())
def hf_attention_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, impl: str,
                        family: str, groups: int, is_causal: bool, scaling: float, grad: torch.Tensor,
                        need: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with autograd_in_op():
        ins = [t.detach().requires_grad_(n) for t, n in zip((q, k, v), need)]
        out = _attention(*ins, mask, impl, family, groups, is_causal, scaling)
        wrt = [t for t in ins if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wrt, grad))
    return tuple(owned(next(grads), q, k, v, grad) if n else t.new_empty(0)  # type: ignore[return-value]
                 for t, n in zip((q, k, v), need))


@hf_attention_bwd_op.register_fake
def _hf_attention_bwd_fake(q, k, v, mask, impl, family, groups, is_causal, scaling, grad, need):
    return tuple(t.new_empty(t.shape) if n else t.new_empty(0) for t, n in zip((q, k, v), need))


def _hf_attention_setup(ctx, inputs, output):
    q, k, v, mask, *rest = inputs
    ctx.save_for_backward(q, k, v, mask)
    ctx.rest = rest


def _hf_attention_backward(ctx, grad):
    q, k, v, mask = ctx.saved_tensors
    need = [bool(n) for n in ctx.needs_input_grad[:3]]
    grads = hf_attention_bwd_op(q, k, v, mask, *ctx.rest, grad, need)
    return (*(g if n else None for g, n in zip(grads, need)), None, None, None, None, None, None)


hf_attention_op.register_autograd(_hf_attention_backward, setup_context=_hf_attention_setup)


# -- the causal LM's own loss (HF's ForCausalLMLoss) -------------------------------------------------


def hf_loss():
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss


def _loss(logits, labels, shift_labels, vocab_size, ignore_index, n_tensor, n_int):
    n = n_tensor if n_tensor is not None else n_int
    return hf_loss()(logits, labels, vocab_size, num_items_in_batch=n, ignore_index=ignore_index,
                     shift_labels=shift_labels)


@torch.library.custom_op("emulator::causal_lm_loss", mutates_args=())
def causal_lm_loss_op(logits: torch.Tensor, labels: torch.Tensor | None, shift_labels: torch.Tensor | None,
                      vocab_size: int, ignore_index: int, n_tensor: torch.Tensor | None,
                      n_int: int | None) -> torch.Tensor:
    return owned(_loss(logits, labels, shift_labels, vocab_size, ignore_index, n_tensor, n_int), logits)


@causal_lm_loss_op.register_fake
def _loss_fake(logits, labels, shift_labels, vocab_size, ignore_index, n_tensor, n_int):
    check_compile_settings()
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


def _loss_setup(ctx, inputs, output):
    logits, labels, shift_labels, vocab_size, ignore_index, n_tensor, n_int = inputs
    ctx.save_for_backward(logits, labels, shift_labels, n_tensor)
    ctx.vocab_size, ctx.ignore_index, ctx.n_int = vocab_size, ignore_index, n_int


def _loss_backward(ctx, grad):
    logits, labels, shift_labels, n_tensor = ctx.saved_tensors
    d = causal_lm_loss_bwd_op(logits, labels, shift_labels, ctx.vocab_size, ctx.ignore_index, n_tensor, ctx.n_int, grad)
    return d, None, None, None, None, None, None


causal_lm_loss_op.register_autograd(_loss_backward, setup_context=_loss_setup)


def loss_function():
    """The ``loss_function`` a patch binds on a causal LM whose loss is HF's ``ForCausalLMLoss``:
    HF's function eagerly, the opaque op while torch.compile traces."""

    def loss(logits, labels=None, vocab_size=None, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
             **kwargs):
        if not torch.compiler.is_compiling():
            return hf_loss()(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                             ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        n_tensor = num_items_in_batch if isinstance(num_items_in_batch, torch.Tensor) else None
        n_int = int(num_items_in_batch) if num_items_in_batch is not None and n_tensor is None else None
        return causal_lm_loss_op(logits, labels, shift_labels, int(vocab_size), int(ignore_index), n_tensor, n_int)

    return loss
