"""Emulator tests run the Triton kernels on CPU through the Triton interpreter.

TRITON_INTERPRET must be set before the kernels are defined (``@triton.jit`` reads it when
``emulator.ops`` is first imported), so it is set here, at collection, before any emulator
import; the kernels are then imported at once. The interpreter also reads the variable while a
kernel runs, so it is set again around each emulator test, and otherwise put back as it was:
subprocesses started by other test folders (engine probes) must not inherit it.
"""

from __future__ import annotations

import pytest
import torch

from ..interpreted import import_emulator_interpreted

if not import_emulator_interpreted():  # pragma: no cover - a setup error, not a test result
    pytest.exit(
        "emulator.ops was imported before tests/emulator/conftest.py could set TRITON_INTERPRET=1 (its kernels "
        "are compiled for GPUs); run the emulator tests in a fresh pytest process",
        returncode=4,
    )

DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _interpreter_environment(monkeypatch):
    """TRITON_INTERPRET=1 while an emulator test runs; tests choose backends explicitly, so a
    user's EMULATOR_BACKEND must not change them."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("EMULATOR_BACKEND", raising=False)


@pytest.fixture(autouse=True)
def _quiet_numpy():
    """The interpreter runs on numpy, which warns on Inf/NaN arithmetic the tests do on purpose."""
    import numpy as np

    with np.errstate(all="ignore"):
        yield
