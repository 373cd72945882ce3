"""Training side: Triton kernels, autograd ops and model patching that reproduce a profile."""

from . import functional
from .errors import BackendError, EmulatorError, InputError, ProfileMismatch, RegionUnavailable

__all__ = ["functional", "EmulatorError", "RegionUnavailable", "ProfileMismatch", "BackendError", "InputError"]
