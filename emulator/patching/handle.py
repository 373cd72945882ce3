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
        self.kv_split = None  # exact mode: the engine's split-KV plan (a KVSplit), None for none
        # exact mode's attention: "engine" (the profile's engine's own kernel) or "portable" (the reference); "" not exact
        self.kernels = ""
        self.kernels_option = "auto"  # apply_profile's kernels= (recorded in the config with record=True)
        self.skip_native = True  # apply_profile's option (recorded in the config with record=True)
        self.norm_backend: str | None = None  # exact mode: the norms' emulator backend
        self._undo: list[Callable[[], None]] = []
        self._stashes: list[Stash] = []
        self._bound: list[tuple[str, torch.nn.Module, Callable[..., Any]]] = []  # (path, module, forward)
        self._hook_fns: list[Callable[..., Any]] = []  # the hooks it registered (a copy's handle removes them)
        self.copy_of: PatchHandle | None = None
        self._holds_numerics = False  # holds Inductor's emulate_precision_casts (guard.py)  # the handle of the model this one's was deep-copied from

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
        self._bound.append((path, module, fn))

        def undo() -> None:
            if module.__dict__.get("forward") is not None:
                del module.forward

        self._undo.append(undo)
        self.modules.append(path)

    def _hook(self, handle: Any, fn: Callable[..., Any] | None = None) -> None:
        self._undo.append(handle.remove)
        if fn is not None:
            self._hook_fns.append(fn)

    def _set(self, module: torch.nn.Module, name: str, value: Any) -> None:
        """A per-model attribute of the patch on ``module`` (``_emulator_*``), removed by remove()."""
        assert name.startswith("_emulator")
        module.__dict__[name] = value
        self._undo.append(lambda: module.__dict__.pop(name, None))


class PatchRecord:
    """What a patch leaves on the decoder module it patched (``_emulator_patch``), so that a
    ``copy.deepcopy`` of the model is a patched model with its own state and its own handle.

    The bound forwards keep no per-model state in their closures (the residual stream's
    :class:`~.carry.Stash` and the first-layer flag live on the modules, and a Stash deep-copies
    to a new, empty one), so the copy's forwards, hooks and loss function compute the same bits on
    the copy's own modules. When the copy is made, this record's ``__deepcopy__`` registers the copy
    as patched (:func:`handle_of` returns its handle; ``apply_profile`` on it is
    :class:`~emulator.errors.AlreadyPatched`) with a handle whose ``remove()`` unpatches the copy
    alone: per-instance forwards, hooks, ``_emulator_*`` attributes and the loss function the patch
    put there."""

    def __init__(self, handle: PatchHandle, decoder: torch.nn.Module, top: torch.nn.Module,
                 losses: list[tuple[str, bool, Any]]):
        self.handle, self.decoder, self.top, self.losses = handle, decoder, top, losses

    def __deepcopy__(self, memo: dict) -> "PatchRecord":
        h = self.handle
        decoder = memo.get(id(self.decoder))
        if decoder is None or not h.active:  # pragma: no cover - only deepcopy(model) reaches here
            raise RuntimeError("a patch record is copied with the model it belongs to, not alone")
        top = memo.get(id(self.top), decoder)  # the copied model, when the copy started at it
        new = PatchHandle(top, h.profile, h.family, h.emulated, h.native)
        new.modules = list(h.modules)
        new.exact, new.norm_backend, new.copy_of, new.skip_native = h.exact, h.norm_backend, h, h.skip_native
        new._hook_fns = list(h._hook_fns)
        record = PatchRecord(new, decoder, top, self.losses if top is not decoder else [])
        ACTIVE[decoder] = new
        new._undo.append(lambda: _unpatch_copy(new, record))
        if h._holds_numerics:
            from .guard import hold_eager_numerics

            new._undo.append(hold_eager_numerics())
            new._holds_numerics = True
        return record


def _unpatch_copy(handle: PatchHandle, record: PatchRecord) -> None:
    """Undo, on a deep copy of a patched model, what the patch bound there (see :class:`PatchRecord`)."""
    for name, mod in record.top.named_modules():
        fwd = mod.__dict__.get("forward")
        if fwd is not None and getattr(getattr(fwd, "__func__", fwd), PATCHED_ATTR, None) is not None:
            del mod.__dict__["forward"]
        for hooks in (mod._forward_pre_hooks, mod._forward_hooks):
            for key in [k for k, fn in hooks.items() if any(fn is f for f in handle._hook_fns)]:
                del hooks[key]
                for extra in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
                              "_forward_hooks_always_called"):
                    getattr(mod, extra, {}).pop(key, None)
        for attr in [k for k in mod.__dict__ if k.startswith("_emulator")]:
            del mod.__dict__[attr]
    mods = dict(record.top.named_modules())
    for path, had, before in record.losses:
        mod = mods.get(path)
        if mod is None:
            continue
        if had:
            mod.__dict__["_loss_function"] = before
        else:
            mod.__dict__.pop("_loss_function", None)
    ACTIVE.pop(record.decoder, None)


def handle_of(model: torch.nn.Module) -> PatchHandle | None:
    """The active :class:`PatchHandle` of a patched model (or of one of its decoder modules), also
    for a ``copy.deepcopy`` of a patched model (its own handle); None when it is not patched."""
    for _, mod in model.named_modules():
        h = ACTIVE.get(mod)
        if h is not None and h.active:
            return h
    return None


def patched_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """The modules of ``model`` that an active patch has bound a forward on."""
    for name, mod in model.named_modules():
        fwd = mod.__dict__.get("forward")
        if fwd is not None and getattr(getattr(fwd, "__func__", fwd), PATCHED_ATTR, None) is not None:
            yield name, mod
