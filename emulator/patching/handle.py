"""The handle apply_profile returns: what it changed, and the way back."""

from __future__ import annotations

import types
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from engineprofiles.schema import Profile

if TYPE_CHECKING:
    from .carry import Stash
    from .families import Family

PATCHED_ATTR = "_emulator_patched"
# Decoder models with an active patch (a patch may bind no forward at all when every region is
# native, so the bound forwards alone cannot tell).
ACTIVE: "weakref.WeakKeyDictionary[torch.nn.Module, PatchHandle]" = weakref.WeakKeyDictionary()


class PatchHandle:
    """What :func:`apply_profile` changed, and the way back.

    ``remove()`` restores every patched module (idempotent); the handle is also a context
    manager that removes the patch on exit. ``emulated`` lists the regions the emulator now
    computes, ``native`` those left to HF's modules because they already round as the profile
    says, ``modules`` the patched module paths."""

    def __init__(self, model: torch.nn.Module, profile: Profile, family: Family, emulated: tuple[str, ...],
                 native: tuple[str, ...]):
        self.model = model
        self.profile = profile
        self.family = family
        self.emulated = emulated
        self.native = native
        self.modules: list[str] = []
        self.exact = False  # exact mode: attention computed as the profile's engine computes it
        self.norm_backend: str | None = None  # exact mode: the norms' emulator backend
        self._undo: list[Callable[[], None]] = []
        self._stashes: list[Stash] = []

    @property
    def active(self) -> bool:
        return bool(self._undo)

    def remove(self) -> None:
        """Restore the model as it was before apply_profile. Safe to call twice."""
        while self._undo:
            self._undo.pop()()
        for s in self._stashes:
            s.clear()
        self.modules = []

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return (
            f"PatchHandle({self.profile.canonical_name}{' (exact)' if self.exact else ''} on {type(self.model).__name__} "
            f"[{self.family.name}], {state}; "
            f"emulated: {', '.join(self.emulated) or 'none'}; native: {', '.join(self.native) or 'none'})"
        )

    # -- used while patching ---------------------------------------------------------------------
    def _bind(self, path: str, module: torch.nn.Module, fn: Callable[..., Any]) -> None:
        setattr(fn, PATCHED_ATTR, self)  # fn is a fresh closure: marking it marks this patch only
        module.forward = types.MethodType(fn, module)

        def undo() -> None:
            if module.__dict__.get("forward") is not None:
                del module.forward

        self._undo.append(undo)
        self.modules.append(path)

    def _hook(self, handle: Any) -> None:
        self._undo.append(handle.remove)


def patched_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """The modules of ``model`` that an active patch has bound a forward on."""
    for name, mod in model.named_modules():
        fwd = mod.__dict__.get("forward")
        if fwd is not None and getattr(getattr(fwd, "__func__", fwd), PATCHED_ATTR, None) is not None:
            yield name, mod
