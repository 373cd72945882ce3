"""Which implementation the regions run (the backends are described in :mod:`emulator.functional`).

The choice is made per call: :func:`use_backend`'s block, else ``$EMULATOR_BACKEND``, else
``auto``. Code compiled by torch.compile cannot read a context variable, so there the backend is
resolved once, when the code is traced (:func:`traced_backend_for`), and each region's custom op
checks at run time that the same backend is still requested (:func:`check_traced`), so compiled
code never silently runs another backend than eager code would.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Iterator

import torch

from ..errors import BackendError

BACKENDS = ("auto", "triton", "reference", "reference-portable", "reference-inductor")
ENV_VAR = "EMULATOR_BACKEND"
_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("emulator_backend", default=None)


def _check_backend_name(name: str, where: str) -> str:
    if name not in BACKENDS:
        raise BackendError(f"unknown emulator backend {name!r} ({where}); choose one of {', '.join(BACKENDS)}")
    return name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run the emulator's functions in this block with backend ``name`` (see emulator.functional)."""
    token = _override.set(_check_backend_name(name, "use_backend"))
    try:
        yield
    finally:
        _override.reset(token)


def current_backend() -> str:
    """The backend requested now: use_backend's, else $EMULATOR_BACKEND, else ``auto``."""
    name = _override.get()
    if name is not None:
        return name
    return _check_backend_name(os.environ.get(ENV_VAR) or "auto", f"${ENV_VAR}")


def backend_for(device: torch.device, override: str | None = None) -> str:
    """The backend a call on ``device`` runs now (``auto`` resolved); ``override``: this call's own."""
    name = _check_backend_name(override, "backend=") if override is not None else current_backend()
    if name == "auto":
        return "triton" if device.type == "cuda" else "reference"
    if name == "triton" and device.type != "cuda" and not _kernels_interpreted():
        raise BackendError(
            f"the triton backend was requested for {device.type} tensors, but the emulator's Triton kernels "
            "were compiled for GPUs: to run them on CPU through the Triton interpreter, set TRITON_INTERPRET=1 "
            "in the environment before emulator is first imported (e.g. TRITON_INTERPRET=1 EMULATOR_BACKEND=triton "
            "python ...); or use backend 'reference-portable', which computes the same bits in torch"
        )
    return name


def _kernels_interpreted() -> bool:
    from . import _utils
    from .rope import _rope_fwd_kernel  # (the kernels' module imports this one)

    return _utils.interpreted(_rope_fwd_kernel)


@torch.compiler.assume_constant_result
def traced_backend_for(device_type: str) -> str:
    """:func:`backend_for` while torch.compile traces: the result is a constant of the compiled code."""
    return backend_for(torch.device(device_type))


def check_traced(backend: str, device: torch.device) -> None:
    """At run time of compiled code: ``backend`` (resolved when it was traced) must still be the
    backend a call on ``device`` would run."""
    now = backend_for(device)
    # exact mode asks for reference-inductor per call (the norms of an Inductor engine), over reference
    if now != backend and not (backend == "reference-inductor" and now == "reference"):
        raise BackendError(
            f"this code was compiled by torch.compile while emulator backend {backend!r} was requested, and backend "
            f"{now!r} is requested now (use_backend or ${ENV_VAR}); compiled code keeps the backend it was traced "
            "with: call torch.compiler.reset() before running it under another backend, so that it is compiled again"
        )
