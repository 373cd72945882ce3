"""Entry points in the ecosystem's habits: class-level patching before ``from_pretrained`` (as
Liger-Kernel's ``apply_liger_kernel_to_qwen2()`` does), and the profile recorded in the model's
config so that a saved model is patched again when it is loaded.

Class level::

    patch = emulator.patch_qwen2("vllm")          # or patch_qwen3, patch_llama, patch_family("qwen2", ...)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)   # patched
    emulator.handle_of(model)                      # its PatchHandle
    patch.remove()                                 # later models are built plain (patched ones stay patched;
                                                   # patch.remove(instances=True) unpatches them too)

Every model of the family built while the class patch is active (``from_pretrained``,
``from_config``, ``Qwen2ForCausalLM(config)``; the outermost model, e.g. the causal LM around its
decoder) is passed to :func:`~emulator.patching.apply.apply_profile` once its weights are there, with
the options given; a refusal is raised where the model is built. A model built on the meta device
(``accelerate.init_empty_weights()``, ``torch.device("meta")``: verl's FSDP workers on every rank
but 0) has no weights yet: it is patched when they have arrived, at its first forward (or earlier
with ``patch.apply_pending()``, e.g. right after the framework loads the state dict);
``patch.pending`` lists such models, and a forward while its weights are still on the meta device
raises :class:`~emulator.errors.PatchError`: it is never left unpatched silently. Unlike Liger, nothing of
transformers' modeling module is replaced: the patch is the instance patch, applied for you.

Recorded in the config::

    handle = emulator.apply_profile(model, profile, record=True)  # model.config.emulator_profile
    model.save_pretrained(path)                                   # config.json carries the profile
    model = AutoModelForCausalLM.from_pretrained(path, ...)       # plain HF: not patched, but ...
    emulator.apply_recorded_profile(model)                        # ... patched as recorded
    patch = emulator.patch_qwen2()                                # or: every model built is patched
                                                                  # with its own recorded profile

The record (``config.emulator_profile``) holds the profile's YAML itself (a profile of one's own
probe needs no file on the loading machine) and the options (``skip_native``, ``exact``).
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
import warnings
from typing import Any

import torch

from engineprofiles.schema import Profile, profile_from_yaml

from ..errors import PatchError, UnsupportedModel
from .families import FAMILIES, families_text
from .handle import PatchHandle, handle_of

CONFIG_KEY = "emulator_profile"


class NoRecordedProfile(UserWarning):
    """A class patch without a profile of its own built a model whose config records none: the model
    is left unpatched."""


# -- the profile recorded in the config --------------------------------------------------------------


def _config(model_or_config: Any) -> Any:
    cfg = getattr(model_or_config, "config", model_or_config)
    if cfg is None or not hasattr(cfg, "to_dict"):
        raise UnsupportedModel(f"{type(model_or_config).__name__} has no HF config (a PretrainedConfig) to record a "
                               "profile in")
    return cfg


def record(handle: PatchHandle) -> None:
    """Write the handle's profile and options into its model's config (``config.emulator_profile``),
    so that ``save_pretrained`` saves them; the handle's ``remove()`` puts the config back."""
    cfg = _config(handle.model)
    had = CONFIG_KEY in cfg.__dict__
    before = cfg.__dict__.get(CONFIG_KEY)
    setattr(cfg, CONFIG_KEY, {
        "name": handle.profile.canonical_name,
        "skip_native": handle.skip_native,
        "exact": handle.exact,
        "kv_split": None if handle.kv_split is None else dataclasses.asdict(handle.kv_split),
        "kernels": handle.kernels_option,
        "profile": handle.profile.to_yaml(),
    })

    def undo() -> None:
        if had:
            setattr(cfg, CONFIG_KEY, before)
        else:
            cfg.__dict__.pop(CONFIG_KEY, None)

    handle._undo.append(undo)


def recorded_profile(model_or_config: Any) -> tuple[Profile, dict[str, Any]] | None:
    """The profile recorded in a model's (or a config's) ``emulator_profile`` and the options it was
    applied with; None when none is recorded. A record that is not one is a ProfileError."""
    from engineprofiles.errors import ProfileError

    cfg = _config(model_or_config)
    rec = getattr(cfg, CONFIG_KEY, None)
    if rec is None:
        return None
    source = f"{type(cfg).__name__}.{CONFIG_KEY}"
    if not isinstance(rec, dict) or not isinstance(rec.get("profile"), str):
        raise ProfileError("not a recorded profile: a mapping with the profile's YAML under 'profile' is expected "
                           f"(written by apply_profile(..., record=True)); got {type(rec).__name__}", source=source)
    options = {}
    for k in ("skip_native", "exact"):
        v = rec.get(k, k == "skip_native")
        if not isinstance(v, bool):
            raise ProfileError(f"{k} must be true or false, got {v!r}", source=source, field=k)
        options[k] = v
    kernels = rec.get("kernels", "auto")  # records written before the option: the default
    from .apply import KERNELS

    if kernels not in KERNELS:
        raise ProfileError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}", source=source, field="kernels")
    options["kernels"] = kernels
    split = rec.get("kv_split")
    if split is not None:
        from engineprofiles.regions.attention import KVSplit

        try:
            options["kv_split"] = KVSplit(**split)
        except (TypeError, ValueError) as e:
            raise ProfileError(f"kv_split must be a KVSplit's fields (threads, ...): {e}", source=source,
                               field="kv_split") from None
        if not options["exact"]:  # what apply_profile would refuse, named here as the record's fault
            raise ProfileError("kv_split is recorded with exact: false; kv_split is part of exact mode's attention, and "
                               "a record written by apply_profile(..., record=True) holds it only with exact: true",
                               source=source, field="kv_split")
    profile = profile_from_yaml(rec["profile"], source)
    name = rec.get("name")  # what record() wrote: the profile's canonical name, which the YAML decides
    if name is not None and name != profile.canonical_name:
        from engineprofiles.safeyaml import short

        raise ProfileError(f"the record names its profile {short(name)}, but the profile it holds is "
                           f"{profile.canonical_name}: the record was edited by hand or put together from two; record "
                           "the profile again (apply_profile(model, profile, record=True))", source=source, field="name")
    return profile, options


def apply_recorded_profile(model: torch.nn.Module, **options: Any) -> PatchHandle:
    """Patch ``model`` with the profile recorded in its config (see :func:`record`), with the recorded
    options unless ``options`` say otherwise; the record stays in the config. Raises
    :class:`~emulator.errors.UnsupportedModel` when none is recorded."""
    from .apply import apply_profile

    found = recorded_profile(model)
    if found is None:
        raise UnsupportedModel(
            f"{type(model).__name__}'s config records no profile (no '{CONFIG_KEY}'); apply one with "
            "emulator.apply_profile(model, profile, record=True) before save_pretrained, or apply a profile by name")
    profile, recorded = found
    return apply_profile(model, profile, **{**recorded, **options, "record": True})


# -- class-level patching ------------------------------------------------------------------------------

_building = threading.local()


class ClassPatch:
    """What :func:`patch_family` changed on a family's classes, and the way back (``remove()``, or
    use it as a context manager). ``handles``: the handles of the models it patched (alive ones)."""

    def __init__(self, family: str, profile: Any, options: dict[str, Any]):
        self.family = family
        self.profile = profile
        self.options = options
        self._handles: list[PatchHandle] = []
        self._undo: list[Any] = []
        self._pending: dict[int, tuple[Any, Any]] = {}  # meta-device builds: id -> (weakref to the model, hook)

    @property
    def active(self) -> bool:
        return bool(self._undo)

    @property
    def handles(self) -> list[PatchHandle]:
        return [h for h in self._handles if h.active]

    @property
    def pending(self) -> list[torch.nn.Module]:
        """Models built on the meta device, to be patched when their weights arrive (their first
        forward, or :meth:`apply_pending`)."""
        return [m for m in (ref() for ref, _ in self._pending.values()) if m is not None]

    def apply_pending(self) -> list[PatchHandle]:
        """Patch every pending model whose weights have arrived (none left on the meta device); the
        others stay pending. Returns the handles made."""
        made = []
        for key, (ref, _) in list(self._pending.items()):
            model = ref()
            if model is not None and not _on_meta(model):
                made.append(self._patch_arrived(key))
        return [h for h in made if h is not None]

    def remove(self, instances: bool = False) -> None:
        """Restore the family's classes (models built afterwards are plain); with ``instances``, also
        remove the patch of every model this class patch patched (and leave its pending models plain)."""
        while self._undo:
            self._undo.pop()()
        if instances:
            for _, hook in self._pending.values():
                hook.remove()
            self._pending.clear()
            for h in self._handles:
                h.remove()
            self._handles.clear()

    def __enter__(self) -> "ClassPatch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        what = self.profile if isinstance(self.profile, (str, type(None))) else getattr(self.profile, "canonical_name", self.profile)
        return (f"ClassPatch({self.family}, profile={what or 'recorded in each config'}, "
                f"{'active' if self.active else 'removed'}, {len(self.handles)} model(s) patched"
                + (f", {len(self.pending)} pending (built on the meta device)" if self._pending else "") + ")")

    # -- what the wrapped classes call -----------------------------------------------------------
    def _patch(self, model: torch.nn.Module) -> None:
        from .apply import apply_profile

        if handle_of(model) is not None:
            return
        if _on_meta(model):  # built without weights: patched when they arrive
            if id(model) not in self._pending:
                self._defer(model)
            return
        if id(model) in self._pending:  # its weights have arrived (from_pretrained, a state dict loaded)
            self._pending.pop(id(model))[1].remove()
        if self.profile is None:
            found = recorded_profile(model)
            if found is None:
                warnings.warn(f"{type(model).__name__}: class patch {self.family} has no profile of its own and the "
                              f"model's config records none ('{CONFIG_KEY}'), so the model is left unpatched",
                              NoRecordedProfile, stacklevel=4)
                return
            handle = apply_recorded_profile(model, **self.options)
        else:
            handle = apply_profile(model, self.profile, **self.options)
        self._handles.append(handle)

    def _defer(self, model: torch.nn.Module) -> None:
        key = id(model)

        @torch.compiler.disable  # run eagerly under torch.compile(model) too: the patch is Python, not a graph
        def first_forward(module: torch.nn.Module, args: Any) -> None:
            if _on_meta(module):
                name = next(n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta)
                raise PatchError(f"{type(module).__name__} was built on the meta device under class patch "
                                 f"{self.family} and runs a forward with {name} still on the meta device: load its "
                                 "weights first (it is patched when they have arrived)")
            self._patch_arrived(key)

        import weakref

        hook = model.register_forward_pre_hook(first_forward)
        self._pending[key] = (weakref.ref(model, lambda _: self._pending.pop(key, None)), hook)

    def _patch_arrived(self, key: int) -> PatchHandle | None:
        model = self._pending[key][0]()
        if model is None:
            return None
        self._patch(model)  # built under the patch: patched, even where the patch was removed meanwhile
        return handle_of(model)


def _on_meta(model: torch.nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def _family_classes(family: str) -> tuple[Any, list[type]]:
    import importlib

    fam = FAMILIES[family]
    mod = importlib.import_module(fam.module)
    base = getattr(mod, f"{fam.prefix}PreTrainedModel")
    classes = [o for o in vars(mod).values() if isinstance(o, type) and issubclass(o, base) and o is not base]
    return base, classes


def patch_family(family: str, profile: Any = None, *, skip_native: bool = True, exact: bool = False,
                 record: bool = False, allow_other_machine: bool = False, kernels: str = "auto") -> ClassPatch:
    """Class-level patching (call it before ``from_pretrained``, as Liger's ``apply_liger_kernel_to_*``):
    every model of ``family`` built while the returned :class:`ClassPatch` is active is patched with
    ``profile`` (anything :func:`~emulator.patching.apply.apply_profile` takes; None: the profile
    recorded in each model's config) and the options given. ``family``: one of
    :data:`~emulator.patching.families.FAMILIES`."""
    if family not in FAMILIES:
        raise UnsupportedModel(f"no model family {family!r}; supported: {families_text()}")
    if allow_other_machine and not exact:
        from ..errors import InputError

        raise InputError("patch_family: allow_other_machine concerns exact mode's claim on this machine; pass "
                         "exact=True with it")
    from .apply import KERNELS

    if kernels not in KERNELS or (kernels == "engine" and not exact):
        from ..errors import InputError

        raise InputError(f"patch_family: kernels must be one of {', '.join(KERNELS)} ('engine' with exact=True: it is "
                         f"exact mode's attention); got {kernels!r}")
    patch = ClassPatch(family, profile, dict(skip_native=skip_native, exact=exact, record=record,
                                             allow_other_machine=allow_other_machine, kernels=kernels))
    base, classes = _family_classes(family)

    for cls in classes:
        had = "__init__" in cls.__dict__
        init = cls.__dict__.get("__init__", cls.__init__)

        def wrapped(self, *args: Any, __init=init, **kwargs: Any) -> None:
            depth = getattr(_building, "depth", 0)
            _building.depth = depth + 1
            try:
                __init(self, *args, **kwargs)
            finally:
                _building.depth = depth
            if depth == 0 and patch.active:  # the outermost model of the family is complete
                patch._patch(self)

        wrapped.__wrapped__ = init  # type: ignore[attr-defined]
        cls.__init__ = wrapped
        patch._undo.append(_restore(cls, "__init__", had, init))

    static = inspect.getattr_static(base, "from_pretrained")
    had = "from_pretrained" in base.__dict__
    func = static.__func__

    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
        out = func(cls, *args, **kwargs)
        model = out[0] if isinstance(out, tuple) else out
        if patch.active and isinstance(model, torch.nn.Module):
            patch._patch(model)
        return out

    base.from_pretrained = classmethod(from_pretrained)
    patch._undo.append(_restore(base, "from_pretrained", had, static))
    return patch


def _restore(cls: type, name: str, had: bool, before: Any):
    def undo() -> None:
        if had:
            setattr(cls, name, before)
        else:
            delattr(cls, name)

    return undo


def _named(family: str):
    def patch(profile: Any = None, *, skip_native: bool = True, exact: bool = False, record: bool = False,
              allow_other_machine: bool = False, kernels: str = "auto") -> ClassPatch:
        return patch_family(family, profile, skip_native=skip_native, exact=exact, record=record,
                            allow_other_machine=allow_other_machine, kernels=kernels)

    patch.__name__ = f"patch_{family}"
    patch.__doc__ = (f"Class-level patching of the {FAMILIES[family].models} family: "
                     f"``patch_family({family!r}, ...)`` (see :func:`patch_family`).")
    return patch


def __getattr__(name: str) -> Any:
    if name.startswith("patch_") and name[len("patch_"):] in FAMILIES:
        return _named(name[len("patch_"):])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
