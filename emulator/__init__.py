"""Training side: Triton kernels, autograd ops and model patching that reproduce a profile.

``emulator.functional`` is the public API (rope, swiglu, rmsnorm, add_rmsnorm; moe, shared_expert,
attention). It is imported on first use, so that ``emulator.ops`` (the kernels) also imports where the profile schema's
dependencies (pydantic) are not installed, e.g. on a bare GPU machine running scripts/gpu_check.py.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import BackendError, EmulatorError, InputError, ProfileMismatch, RegionUnavailable

_PATCHING = ("apply_profile", "PatchHandle", "handle_of", "apply_recorded_profile", "recorded_profile",
             "patch_family", "ClassPatch")

__all__ = [
    "functional", "as_sampled", *_PATCHING, "patch_qwen2", "patch_qwen3", "patch_llama", "patch_mistral", "patch_qwen3_moe",
    "patch_qwen2_moe",
    "EmulatorError", "RegionUnavailable", "ProfileMismatch", "BackendError", "InputError",
]


def __getattr__(name: str) -> Any:
    if name == "as_sampled":  # exact mode with kv_split: one forward as the engine sampled
        return importlib.import_module(".ops.attention", __name__).as_sampled
    if name == "functional":
        return importlib.import_module(".functional", __name__)
    if name in _PATCHING or name.startswith("patch_"):  # model patching (emulator/patching/); patch_<family>
        return getattr(importlib.import_module(".patching", __name__), name)
    raise AttributeError(f"module 'emulator' has no attribute {name!r}")
