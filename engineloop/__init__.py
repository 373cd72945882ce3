"""The engine in the loop, and the command line: the top layer.

Runs a real engine on a tiny local model and compares the trainer with it (in-situ capture and
fit, end-to-end log-prob mismatch), and holds ``probe-engine`` (:mod:`engineloop.cli`). It uses
both layers below it: :mod:`engineprofiles` (profiles, region semantics, op-level probing) and
:mod:`emulator` (the trainer-side kernels and model patching). Nothing below imports it.

``engineloop.capture`` runs inside an engine's own environment and imports only the engine and
torch.
"""
