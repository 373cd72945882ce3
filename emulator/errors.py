"""Typed errors of the emulator. Each message says what was wrong and what to do."""

# CapabilityMismatch (a warning: a profile probed on another CPU vector ISA or device) is defined in
# engineprofiles.errors, where choosing a profile by engine name warns with it too; exact mode warns
# with the same class, re-exported here.
from engineprofiles.errors import CapabilityMismatch, EngineProfilesError, MachineMismatch  # noqa: F401


class EmulatorError(EngineProfilesError):
    """Base class of every error the emulator raises on purpose."""


class RegionUnavailable(EmulatorError, ValueError):
    """The profile records the region as unavailable (the engine could not run it), so it says
    nothing about how to round there."""


class ProfileMismatch(EmulatorError, ValueError):
    """The profile (or lattice point) does not fit the call: wrong region or activation dtype."""


class BackendError(EmulatorError, RuntimeError):
    """The requested backend cannot run here (unknown name, or Triton on CPU without the
    interpreter)."""


class InputError(EmulatorError, ValueError):
    """A tensor argument has the wrong shape, dtype or device."""


# -- apply_profile -------------------------------------------------------------------------------


class PatchError(EmulatorError, ValueError):
    """apply_profile refused the model; nothing was changed."""


class UnsupportedModel(PatchError):
    """The model (or one of its modules, or its RoPE type) is not one apply_profile can patch."""


class AlreadyPatched(PatchError):
    """The model is already patched; remove the first handle before applying another profile."""


class CompileUnsupported(PatchError):
    """torch.compile and a patched model in a configuration whose compiled code would not compute the
    eager patched model's bits (native regions, gradient checkpointing, ...; see
    emulator.patching.guard); raised when torch.compile traces the patched model."""


class ExactModeUnavailable(PatchError):
    """apply_profile(..., exact=True) with a profile or model exact mode cannot reproduce (no measured
    attention in the profile, sliding-window attention, attention dropout); nothing was changed."""


class InexactEvidence(UserWarning):
    """exact mode with a profile whose own evidence is not bitwise (its attention matched the engine
    on fewer than every element): the trainer reproduces the profile's point, not the engine."""


class StackNotCompiled(UserWarning):
    """exact mode for an engine that compiles its whole model (vLLM's CPU build) could not compile the
    trainer's decoder stack as one graph (e.g. gradient checkpointing); it runs eagerly with its norms
    compiled one at a time, which on wider models does not reproduce the engine's reduction order."""


class ResidualStreamLost(EmulatorError, RuntimeError):
    """A patched decoder layer (not the first) or the final norm got a hidden state that no patched
    layer produced, so the (MLP output, residual) pair the engine's fused add needs is unknown."""
