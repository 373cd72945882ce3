"""Training side: Triton kernels, autograd ops and model patching that reproduce a profile."""
