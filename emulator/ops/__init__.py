"""The Triton kernels of the emulator, one module per region (kernels, launchers, autograd
Function), Liger-Kernel style. ``_rne`` rounds, ``_portable`` is the kernels' portable math."""
