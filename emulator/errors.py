"""Typed errors of the emulator. Each message says what was wrong and what to do."""

from engineprofiles.errors import EngineProfilesError


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
