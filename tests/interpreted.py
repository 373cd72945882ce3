"""Define the emulator's Triton kernels for the Triton interpreter, whoever imports it first.

``@triton.jit`` reads TRITON_INTERPRET when a kernel is defined (at the first import of
``emulator.ops``), so the variable is set around that import and put back afterwards: subprocesses
started later (engine probes) must not inherit it. tests/emulator/conftest.py and
tests/bad_inputs.py both import the emulator this way, so either may come first.
"""

from __future__ import annotations

import os


def import_emulator_interpreted() -> bool:
    """Import ``emulator.functional`` (which defines every kernel) with TRITON_INTERPRET=1; True when
    the kernels are defined for the interpreter (False: something imported them before, for GPUs)."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import emulator.functional  # noqa: F401  (defines every kernel)
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
    from emulator.ops import _utils
    from emulator.ops.rope import _rope_fwd_kernel

    return _utils.interpreted(_rope_fwd_kernel)
