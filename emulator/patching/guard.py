"""torch.compile and a patched model: what the compiled code needs to compute the eager patched
model's bits, and what is refused.

A patched model compiles (``torch.compile(model)``, the default Inductor backend, whole or layer by
layer) to the same bits as the eager patched model, forward and backward
(tests/emulator/test_compile.py). A model compiled before it is patched works too: the compiled
code guards on the modules' forwards, so its next call compiles the patched model. Because:

* every emulated region (and exact mode's attention) is a custom op (emulator/ops/), which Inductor
  calls as an opaque operation: it can neither drop a rounding inside nor fuse into it;
* the HF code around the regions whose kernels Inductor would change runs as opaque ops while
  traced (:mod:`.opaque`: cos/sin, the embedding's gradient, biased linears, HF's attention
  function, the causal LM's own loss);
* the residual stream is carried by identity while tracing (:class:`.carry.Stash`);
* while a patch is active, ``torch._inductor.config.emulate_precision_casts`` is True: Inductor
  then rounds every BF16/FP16 intermediate of the code it fuses where eager torch rounds it (else
  it keeps e.g. the sum of the gradients of one activation, eager's chain of BF16 adds, in FP32).
  The setting is process-wide; it is put back when the last active patch is removed. It reaches
  whatever else compiles in the process meanwhile: a colocated engine (vLLM compiled) that
  compiles a new shape while a patch is active no longer rounds as it does on its own
  (scripts/check_emulator_vs_engine.py runs the engine before the patch for this reason).

Refused with :class:`CompileUnsupported` (each message says what to do instead):

* a patch that leaves a region to HF's own module (``skip_native``; when traced, wherever
  compiling starts): Inductor would compile HF's code for it, not as eager HF rounds;
* gradient checkpointing (when traced): a checkpointed layer does not hand the residual stream
  on under torch.compile (measured: not bit-equal);
* an attention implementation other than sdpa/eager, and attention dropout in training (normal
  mode, when traced; :func:`.forwards.attention`);
* Inductor with ``emulate_precision_casts`` off, e.g. through ``torch.compile``'s options (inside
  Inductor, by the fake implementations of :mod:`.opaque`'s ops; Dynamo reports it as
  ``BackendCompilerFailed`` whose ``inner_exception`` is the CompileUnsupported).

A refusal raised where torch.compile traces would make Dynamo run the frame eagerly instead, so
it is raised from a function torch.compile does not trace (:func:`refusal`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CompileUnsupported

def refusal(message: str):
    """A function that, called where torch.compile traces, raises :class:`CompileUnsupported`
    (``message``) to the caller. Traced code cannot raise to the caller (Dynamo would run the
    frame eagerly instead, or report its own generic "Observed exception"), so the raise runs
    outside the compiled graph, from a function torch.compile does not trace; under
    ``fullgraph=True`` the message is the graph break's reason."""
    return refusal_as(CompileUnsupported, message)


def refusal_as(error: type[Exception], message: str):
    """:func:`refusal` raising ``error(message)``: an error of the patch that may be raised where
    torch.compile traces (e.g. :class:`~emulator.errors.ResidualStreamLost`) reaches the caller as
    itself, eagerly and compiled."""

    def refuse() -> None:
        raise error(message)

    try:
        return torch.compiler.disable(refuse, reason=f"{error.__name__}: {message}")
    except TypeError:  # pragma: no cover - a torch whose disable takes no reason (before 2.8)
        return torch.compiler.disable(refuse)


def refusal_hook(message: str):
    """A forward pre-hook that refuses to be compiled (see :func:`refusal`)."""
    refuse = refusal(message)

    def hook(module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            refuse()

    return hook


def checkpointing_message(path: str) -> str:
    return (
        f"{path}: gradient checkpointing is on, and under torch.compile a checkpointed layer does not hand the "
        "patch's residual stream (its MLP output and residual) on to the next layer as eager code does (measured: "
        "the compiled model's gradients are not the eager patched model's, or the stream is lost). Compile without "
        "gradient checkpointing (model.gradient_checkpointing_disable()), or run the patched model eagerly with it"
    )


def checkpointing_hook(path: str):
    """A forward pre-hook for the decoder: refuses to be compiled while its layers checkpoint (a
    layer compiled alone refuses in its forward, :func:`.forwards.layer`). It reads the layers of
    the module it runs on (a deepcopy of the model has its own)."""
    refuse = refusal(checkpointing_message(path))

    def hook(module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling() and any(getattr(m, "gradient_checkpointing", False) and m.training
                                                 for m in module.layers):
            refuse()

    return hook


def native_message(native: tuple[str, ...], profile_name: str) -> str:
    return (
        f"this model is patched with profile {profile_name}, whose point for region(s) {', '.join(native)} is what "
        "HF's own modules compute, so the patch left those regions to HF's modules (skip_native); torch.compile "
        "would compile HF's code there with Inductor's reductions and fusions, which do not round as eager HF "
        "does. To compile, apply the profile with skip_native=False (the emulator then computes every region: "
        "the same forward bits, its straight-through FP32 backward), or run the patched model eagerly"
    )


# -- Inductor's eager numerics while a patch is active -------------------------------------------

_active = 0
_saved: bool | None = None


def hold_eager_numerics() -> Any:
    """Turn ``emulate_precision_casts`` on while a patch is active; returns the release to call
    when that patch is removed (the setting is put back when the last one is)."""
    global _active, _saved
    import torch._inductor.config as inductor_config

    if _active == 0:
        _saved = inductor_config.emulate_precision_casts
        inductor_config.emulate_precision_casts = True
    _active += 1
    released = False

    def release() -> None:
        global _active, _saved
        nonlocal released
        if released:
            return
        released = True
        _active -= 1
        if _active == 0 and _saved is not None:
            inductor_config.emulate_precision_casts = _saved
            _saved = None

    return release
