"""The Triton kernels of the emulator, one module per region (kernels, launchers, autograd
Function), Liger-Kernel style. ``tl_rounding`` rounds, ``tl_portable`` is the kernels' portable math.

Every module here imports Triton, the CPU reference path too (through this package): without it,
importing the emulator fails here with a message naming the extra that installs it."""

from engineprofiles.extras import require as _require

_require("emulator", "the emulator (emulator.functional, emulator.apply_profile)")
