"""Emulator tests run the Triton kernels on CPU through the Triton interpreter.

TRITON_INTERPRET must be set before the kernels are defined (``@triton.jit`` reads it when
``emulator.ops`` is first imported), so it is set here, at collection, before any emulator
import; the kernels are then imported at once. The interpreter also reads the variable while a
kernel runs, so it is set again around each emulator test, and otherwise put back as it was:
subprocesses started by other test folders (engine probes) must not inherit it.
"""

from __future__ import annotations

import os

_before = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    import emulator.functional  # noqa: E402,F401  (defines every kernel)
    from emulator.ops import _utils  # noqa: E402
    from emulator.ops.rope import _rope_fwd_kernel  # noqa: E402
finally:
    if _before is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _before

import pytest  # noqa: E402
import torch  # noqa: E402

if not _utils.interpreted(_rope_fwd_kernel):  # pragma: no cover - a setup error, not a test result
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
