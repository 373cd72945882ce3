"""The Triton kernels of the emulator, one module per region (kernels, launchers, autograd
Function), Liger-Kernel style. ``tl_rounding`` rounds, ``tl_portable`` is the kernels' portable math."""
