"""torch.compile and a patched model: refused with :class:`CompileUnsupported`, at apply time
(a compiled module) and at trace time (a pre-hook on every patched module)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CompileUnsupported

COMPILE_MESSAGE = (
    "a model patched by emulator.apply_profile cannot be compiled with torch.compile: Inductor rewrites "
    "the rounding of the code it compiles (it drops intermediate BF16 casts), so the compiled model would "
    "no longer round where the profile says. Run the patched model eagerly, or remove the patch "
    "(handle.remove()) before compiling"
)


def _compile_guard_impl(module: torch.nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling():
        raise CompileUnsupported(f"{COMPILE_MESSAGE} (module {type(module).__name__})")


# Dynamo falls back to running a frame eagerly when traced code raises, which would skip the
# check; marking the guard's frame error_on_graph_break makes the raise reach the caller.
_eogb = getattr(getattr(torch, "_dynamo", None), "error_on_graph_break", None)
compile_guard = _eogb(True)(_compile_guard_impl) if _eogb is not None else _compile_guard_impl


def compiled_modules(model: torch.nn.Module) -> list[str]:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover
        OptimizedModule = ()  # type: ignore[assignment]
    found = []
    for name, mod in model.named_modules():
        if isinstance(mod, OptimizedModule) or getattr(mod, "_compiled_call_impl", None) is not None:
            found.append(name or type(mod).__name__)
    return found
