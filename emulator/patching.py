"""Load a profile into a HF transformers model: ``handle = emulator.apply_profile(model, profile)``.

The patch makes the trainer round where the engine rounds, in the three regions of the rounding
model, by binding per-instance forwards on the model's own modules (found by class on the live
model, so PEFT-wrapped and already-instantiated models work):

* SwiGLU: the MLP computes ``down_proj(swiglu(gate_proj(x), up_proj(x)))``.
* RoPE: the attention applies ``functional.rope`` to q and k with FP32 cos/sin (the rotary
  embedding returns them in FP32, computed from ``rope_theta`` as
  :func:`engineprofiles.regions.rope_cos_sin` does, as engines do, whatever the dtype of HF's
  ``inv_freq`` buffer); Qwen3's q/k norms are plain RMSNorm sites, and an FP32 ``output`` is
  handed on to RoPE.
* Residual RMSNorm: the decoder layer runs the engine's residual path, where the add is fused
  into the next norm. Per layer ``i`` (``m`` = MLP output, ``a`` = attention output)::

      layer 0:  residual = h; x = rmsnorm(h)                       [profile.rmsnorm]
      layer i:  x, residual = add_rmsnorm(m_prev, residual)        [profile.add_rmsnorm]
                a = self_attn(x)
                x2, residual = add_rmsnorm(a, residual)
                m = mlp(x2)
      final:    out, _ = add_rmsnorm(m_last, residual)

  HF's decoder loop passes one tensor between layers, so each patched layer returns
  ``h = m + residual`` (in the residual's dtype: an FP32 residual stream stays FP32) and records
  ``(m, residual)`` in a per-model stash keyed by where ``h`` lives (data pointer, shape, stride,
  dtype; FSDP2's hooks re-wrap tensors, so not by identity). The next layer and the final norm
  look their input up there. An entry lives exactly as long as ``h``'s storage (gradient
  checkpointing keeps it for the recompute); expired entries are dropped. The gradient reaches
  the previous layer through ``h`` (:class:`_Carry`), so reentrant checkpointing and FSDP2's
  post-backward hooks see it where HF's would.

Regions whose profile point is the one HF's own module computes (:data:`NATIVE`) are left as
they are unless ``skip_native=False``: HF's code already rounds there, and its autograd backward
is kept, so applying the trainer's own profile changes no bit of the outputs or the gradients.
(RoPE is emulated anyway when the model's ``inv_freq`` buffer was rounded by ``model.to(dtype)``.)
Emulated regions use the emulator's straight-through FP32 backward.

All or nothing: every check runs before anything changes; a refused model is untouched.
Applying a profile to a model that is already patched raises :class:`AlreadyPatched` (remove the
first handle, then apply another). ``handle.remove()`` restores the original modules exactly.
torch.compile of a patched model is refused (:class:`CompileUnsupported`): Inductor rewrites the
rounding inside the code it compiles (the vLLM profiles measure exactly that), so a compiled
patched model would no longer round where the profile says.
"""

from __future__ import annotations

import importlib
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from engineprofiles.regions import ADD_SPEC, FP32, PLAIN_SPEC, REGIONS, ROPE_SPEC, ROUNDED, SWIGLU_SPEC, Point, rope_cos_sin
from engineprofiles.rounding import ACT_DTYPES
from engineprofiles.schema import Profile
from engineprofiles.store import get_profile

from . import functional as F
from .errors import EmulatorError, ProfileMismatch, RegionUnavailable

__all__ = [
    "apply_profile", "PatchHandle", "FAMILIES", "NATIVE", "PatchError", "UnsupportedModel", "AlreadyPatched",
    "CompileUnsupported", "ResidualStreamLost",
]


# -- errors ---------------------------------------------------------------------------------------


class PatchError(EmulatorError, ValueError):
    """apply_profile refused the model; nothing was changed."""


class UnsupportedModel(PatchError):
    """The model (or one of its modules, or its RoPE type) is not one apply_profile can patch."""


class AlreadyPatched(PatchError):
    """The model is already patched; remove the first handle before applying another profile."""


class CompileUnsupported(PatchError):
    """torch.compile and a patched model: the compiled code would not round where the profile says."""


class ResidualStreamLost(EmulatorError, RuntimeError):
    """A patched decoder layer (not the first) or the final norm got a hidden state that no patched
    layer produced, so the (MLP output, residual) pair the engine's fused add needs is unknown."""


# -- what HF computes natively, and the families ---------------------------------------------------

# The lattice point each region's HF module computes (eager, any device): cos/sin cast to the
# activation dtype and each product rounded (apply_rotary_pos_emb in BF16); act_fn(gate) rounded
# before it multiplies up; the residual add in BF16 then a norm that rounds x*rstd before the
# weight multiply. tests/emulator/test_patching.py checks these against the probe of the
# installed transformers.
NATIVE: dict[str, Point] = {
    "rope": ROPE_SPEC.point(cos_sin=ROUNDED, products=ROUNDED, fma="none"),
    "swiglu": SWIGLU_SPEC.point(silu=ROUNDED, silu_formula="fused"),
    "add_rmsnorm": ADD_SPEC.point(
        variance_input=ROUNDED, normalize_input=ROUNDED, normalized=ROUNDED, residual_out=ROUNDED, rstd="rsqrt"
    ),
    "rmsnorm": PLAIN_SPEC.point(normalized=ROUNDED, output=ROUNDED, rstd="rsqrt"),
}


@dataclass(frozen=True)
class Family:
    name: str
    models: str  # the HF model types it covers, for messages
    module: str
    prefix: str
    qk_norm: bool

    def classes(self) -> dict[str, Any]:
        m = importlib.import_module(self.module)
        p = self.prefix
        return dict(
            model=getattr(m, f"{p}Model"), layer=getattr(m, f"{p}DecoderLayer"), attention=getattr(m, f"{p}Attention"),
            mlp=getattr(m, f"{p}MLP"), norm=getattr(m, f"{p}RMSNorm"), rotary=getattr(m, f"{p}RotaryEmbedding"),
            eager_attention=m.eager_attention_forward,
        )


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("qwen2", "Qwen2, Qwen2.5", "transformers.models.qwen2.modeling_qwen2", "Qwen2", qk_norm=False),
        Family("qwen3", "Qwen3", "transformers.models.qwen3.modeling_qwen3", "Qwen3", qk_norm=True),
        Family("llama", "Llama", "transformers.models.llama.modeling_llama", "Llama", qk_norm=False),
    )
}


def _families_text() -> str:
    return ", ".join(f"{f.name} ({f.models}: {f.prefix}Model)" for f in FAMILIES.values())


# -- the residual stash ---------------------------------------------------------------------------


def _storage_ref(t: torch.Tensor):
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


class _Stash:
    """(MLP output, residual) of each patched layer's output ``h``, found again by where ``h``
    lives. An entry is valid while ``h``'s storage is alive (so it cannot match a tensor that
    reuses the memory later), and is dropped once that storage is freed."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[Any, torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def _key(t: torch.Tensor) -> tuple:
        return (t.device, t.dtype, t.data_ptr(), tuple(t.shape), t.stride())

    def put(self, h: torch.Tensor, m: torch.Tensor, residual: torch.Tensor) -> None:
        self.purge()
        self._entries[self._key(h)] = (_storage_ref(h), m, residual)

    def get(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        e = self._entries.get(self._key(t))
        if e is None or e[0].expired() or e[0] != _storage_ref(t):
            return None
        return e[1], e[2]

    def purge(self) -> None:
        for k in [k for k, e in self._entries.items() if e[0].expired()]:
            del self._entries[k]

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


class _Carry(torch.autograd.Function):
    """Hand the stashed (m, residual) on as values while the gradient flows through ``h``.

    ``h = m + residual`` is what the previous layer returned; the next region is
    ``add_rmsnorm(m, residual)``, whose backward gives both inputs the gradient of their FP32 sum
    s (straight-through). So the gradient of h is that of the residual input (in h's dtype,
    which is the residual's), and autograd carries it from h back to m and the residual."""

    @staticmethod
    def forward(ctx, h, pair):  # type: ignore[override]
        m, residual = pair
        return m.detach(), residual.detach()

    @staticmethod
    def backward(ctx, dm, dresidual):  # type: ignore[override]
        return dresidual, None


# -- compile guard --------------------------------------------------------------------------------

_COMPILE_MESSAGE = (
    "a model patched by emulator.apply_profile cannot be compiled with torch.compile: Inductor rewrites "
    "the rounding of the code it compiles (it drops intermediate BF16 casts), so the compiled model would "
    "no longer round where the profile says. Run the patched model eagerly, or remove the patch "
    "(handle.remove()) before compiling"
)


def _compile_guard_impl(module: torch.nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling():
        raise CompileUnsupported(f"{_COMPILE_MESSAGE} (module {type(module).__name__})")


# Dynamo falls back to running a frame eagerly when traced code raises, which would skip the
# check; marking the guard's frame error_on_graph_break makes the raise reach the caller.
_eogb = getattr(getattr(torch, "_dynamo", None), "error_on_graph_break", None)
_compile_guard = _eogb(True)(_compile_guard_impl) if _eogb is not None else _compile_guard_impl


def _compiled_modules(model: torch.nn.Module) -> list[str]:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover
        OptimizedModule = ()  # type: ignore[assignment]
    found = []
    for name, mod in model.named_modules():
        if isinstance(mod, OptimizedModule) or getattr(mod, "_compiled_call_impl", None) is not None:
            found.append(name or type(mod).__name__)
    return found


# -- the handle -----------------------------------------------------------------------------------

_PATCHED_ATTR = "_emulator_patched"
# Decoder models with an active patch (a patch may bind no forward at all when every region is
# native, so the bound forwards alone cannot tell).
_ACTIVE: "weakref.WeakKeyDictionary[torch.nn.Module, PatchHandle]" = weakref.WeakKeyDictionary()


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
        self._undo: list[Callable[[], None]] = []
        self._stashes: list[_Stash] = []

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
            f"PatchHandle({self.profile.canonical_name} on {type(self.model).__name__} [{self.family.name}], {state}; "
            f"emulated: {', '.join(self.emulated) or 'none'}; native: {', '.join(self.native) or 'none'})"
        )

    # -- used while patching ---------------------------------------------------------------------
    def _bind(self, path: str, module: torch.nn.Module, fn: Callable[..., Any]) -> None:
        setattr(fn, _PATCHED_ATTR, self)  # fn is a fresh closure: marking it marks this patch only
        module.forward = types.MethodType(fn, module)

        def undo() -> None:
            if module.__dict__.get("forward") is not None:
                del module.forward

        self._undo.append(undo)
        self.modules.append(path)

    def _hook(self, handle: Any) -> None:
        self._undo.append(handle.remove)


# -- checks (nothing changes before all pass) ------------------------------------------------------


@dataclass
class _Decoder:
    path: str
    module: torch.nn.Module
    family: Family
    classes: dict[str, Any]
    rope_theta: float = 0.0
    rotary_dim: int = 0
    inv_freq_exact: bool = True  # HF's inv_freq buffer holds the FP32 frequencies engines use
    layers: list[torch.nn.Module] = field(default_factory=list)


def _find_decoders(model: torch.nn.Module) -> list[_Decoder]:
    found: list[_Decoder] = []
    for fam in FAMILIES.values():
        try:
            cls = fam.classes()
        except (ImportError, AttributeError):  # pragma: no cover - a transformers without this family
            continue
        for path, mod in model.named_modules():
            if isinstance(mod, cls["model"]):
                found.append(_Decoder(path or "(top level)", mod, fam, cls))
    return found


def _check_module(path: str, mod: Any, cls: Any, what: str) -> None:
    if not isinstance(mod, cls):
        raise UnsupportedModel(
            f"{path} is a {type(mod).__name__}, not the family's {cls.__name__} ({what}); apply_profile patches the "
            "model's own transformers modules: apply it before other kernel patches (e.g. Liger), or not at all"
        )


def _check_decoder(d: _Decoder) -> None:
    c, m, p = d.classes, d.module, d.path
    layers = list(m.layers)
    if not layers:
        raise UnsupportedModel(f"{p} has no decoder layers")
    for i, layer in enumerate(layers):
        lp = f"{p}.layers.{i}"
        _check_module(lp, layer, c["layer"], "decoder layer")
        _check_module(f"{lp}.self_attn", layer.self_attn, c["attention"], "attention")
        _check_module(f"{lp}.mlp", layer.mlp, c["mlp"], "MLP")
        for n in ("input_layernorm", "post_attention_layernorm"):
            _check_module(f"{lp}.{n}", getattr(layer, n), c["norm"], "RMSNorm")
        if d.family.qk_norm:
            for n in ("q_norm", "k_norm"):
                _check_module(f"{lp}.self_attn.{n}", getattr(layer.self_attn, n), c["norm"], "q/k RMSNorm")
    _check_module(f"{p}.norm", m.norm, c["norm"], "final RMSNorm")
    _check_module(f"{p}.rotary_emb", m.rotary_emb, c["rotary"], "rotary embedding")
    cfg = m.config
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModel(f"{p}: hidden_act is {act!r}; the SwiGLU region is silu(gate) * up (hidden_act 'silu')")
    rot = m.rotary_emb
    rope_type = getattr(rot, "rope_type", "default")
    if rope_type != "default":
        raise UnsupportedModel(
            f"{p}.rotary_emb: rope_type {rope_type!r} is not supported: profiles measure RoPE with the default "
            "frequencies (rope_type 'default'); scaled variants (linear, dynamic, yarn, llama3, ...) change cos/sin "
            "in ways the RoPE region does not model"
        )
    scaling = float(getattr(rot, "attention_scaling", 1.0))
    if scaling != 1.0:
        raise UnsupportedModel(f"{p}.rotary_emb: attention_scaling is {scaling}; only 1.0 (default RoPE) is supported")
    params = getattr(cfg, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta is None:
        raise UnsupportedModel(f"{p}: the config has no rope_theta (rope_parameters['rope_theta'])")
    head_dim = layers[0].self_attn.head_dim
    rotary_dim = 2 * rot.inv_freq.numel()
    if rotary_dim != head_dim:
        raise UnsupportedModel(
            f"{p}.rotary_emb rotates {rotary_dim} of {head_dim} lanes; only full-head RoPE is supported"
        )
    d.rope_theta, d.rotary_dim, d.layers = float(theta), rotary_dim, layers
    # ``model.to(torch.bfloat16)`` also rounds the rotary embedding's FP32 inv_freq buffer, and HF
    # then rotates by rounded frequencies, which no engine does; such a model gets the emulator's
    # RoPE (cos/sin from rope_theta in FP32) even where HF's RoPE has the profile's rounding sites.
    exact = 1.0 / (float(theta) ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    d.inv_freq_exact = rot.inv_freq.dtype == torch.float32 and torch.equal(rot.inv_freq.detach().cpu(), exact)


def _check_dtype(d: _Decoder, profile: Profile, act: torch.dtype) -> None:
    """Every weight the model computes with must be in the profile's dtype (PEFT adapter weights,
    which PEFT keeps in FP32 and casts its output back, are exempt)."""
    for name, prm in d.module.named_parameters():
        if any(part.startswith("lora_") for part in name.split(".")):
            continue
        if prm.is_floating_point() and prm.dtype != act:
            raise ProfileMismatch(
                f"{d.path}.{name} is {prm.dtype}, but profile {profile.canonical_name} was measured in {profile.dtype}: "
                f"the model must run in the profile's dtype (load it with dtype=torch.{profile.dtype}), or use a "
                f"profile probed in {prm.dtype}"
            )


def _check_patchable(model: torch.nn.Module, decoders: list[_Decoder]) -> None:
    compiled = _compiled_modules(model)
    if compiled:
        raise CompileUnsupported(f"{_COMPILE_MESSAGE}; compiled here: {', '.join(compiled[:4])}")
    for d in decoders:
        handle = _ACTIVE.get(d.module)
        if handle is None:
            for _, mod in d.module.named_modules():
                fwd = mod.__dict__.get("forward")
                handle = handle or getattr(getattr(fwd, "__func__", fwd), _PATCHED_ATTR, None)
        if handle is not None:
            raise AlreadyPatched(
                f"{d.path} is already patched with profile {handle.profile.canonical_name}; applying twice is an "
                "error: call remove() on the first handle, then apply the new profile"
            )
        for path, mod in d.module.named_modules():
            if "forward" in mod.__dict__:
                where = f"{d.path}.{path}" if path else d.path
                raise UnsupportedModel(
                    f"{where} ({type(mod).__name__}) already has a per-instance forward (accelerate hooks or another "
                    "patch); apply_profile binds its own forwards and would discard it"
                )


def _regions(profile: Profile) -> dict[str, Point]:
    points = {}
    for r in REGIONS:
        if not profile.available(r):
            raise RegionUnavailable(
                f"profile {profile.canonical_name} records region {r} as unavailable "
                f"({profile.entry(r).evidence.reason}); apply_profile needs every region the model runs "
                f"({', '.join(REGIONS)}), so it changes nothing: use a profile in which all were measured"
            )
        points[r] = REGIONS[r].canonicalize(profile.point(r))
    return points


# -- the patched forwards -------------------------------------------------------------------------


def _norm_plain(profile: Profile, act: torch.dtype, *, to_act: bool):
    """A plain RMSNorm site (first layer's input norm, q/k norms). ``to_act``: the output feeds a
    matmul, so an FP32 ``output`` site is rounded there (RNE, as the matmul's input)."""

    def forward(self, hidden_states):
        y = F.rmsnorm(hidden_states, self.weight, self.variance_epsilon, profile)
        return y.to(act) if to_act and y.dtype != act else y

    return forward


def _mlp(profile: Profile):
    def forward(self, x):
        return self.down_proj(F.swiglu(self.gate_proj(x), self.up_proj(x), profile))

    return forward


def _rotary(theta: float, rotary_dim: int):
    def forward(self, x, position_ids):
        # FP32 cos/sin, in HF's layout [batch, tokens, rotary_dim] (halves repeated); the RoPE
        # region's cos_sin site decides whether they are rounded.
        cos, sin = rope_cos_sin(position_ids, rotary_dim, theta)
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    return forward


def _attention(profile: Profile, qk_norm: bool, eager_attention: Callable[..., Any]):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape)
        k = self.k_proj(hidden_states).view(hidden_shape)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)  # may hand FP32 on to RoPE
        cos, sin = position_embeddings
        half = cos.shape[-1] // 2
        cos, sin = cos[..., :half], sin[..., :half]
        q = F.rope(q, cos, sin, profile, style="neox").transpose(1, 2)
        k = F.rope(k, cos, sin, profile, style="neox").transpose(1, 2)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention)
        extra = {"sliding_window": self.sliding_window} if hasattr(self, "sliding_window") else {}
        out, weights = attention_interface(
            self, q, k, v, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling, **extra, **kwargs,
        )
        out = out.reshape(*input_shape, -1).contiguous()
        return self.o_proj(out), weights

    return forward


def _layer(profile: Profile, stash: _Stash, first: torch.nn.Module, path: str):
    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs):
        if self is first:
            residual = hidden_states
            x = self.input_layernorm(hidden_states)  # plain RMSNorm: no add before the first layer
        else:
            carried = stash.get(hidden_states)
            if carried is None:
                raise ResidualStreamLost(
                    f"{path}: this decoder layer's input was not produced by the patched layer before it, so the "
                    "engine's fused residual add cannot be reproduced. Something between the layers replaced the "
                    "hidden state (for example FSDP2's MixedPrecisionPolicy with cast_forward_inputs=True casting an "
                    "FP32 residual stream, or a hook returning a new tensor); run the layers in order through the "
                    "model's forward and do not cast or copy the hidden states between them"
                )
            m, r = _Carry.apply(hidden_states, carried)
            ln = self.input_layernorm
            x, residual = F.add_rmsnorm(m, r, ln.weight, ln.variance_epsilon, profile)
        a, _ = self.self_attn(
            hidden_states=x, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs,
        )
        ln = self.post_attention_layernorm
        x2, residual = F.add_rmsnorm(a, residual, ln.weight, ln.variance_epsilon, profile)
        m = self.mlp(x2)
        h = m.to(residual.dtype) + residual
        stash.put(h, m, residual)
        return h

    return forward


def _final_norm(profile: Profile, stash: _Stash, path: str):
    def forward(self, hidden_states):
        carried = stash.get(hidden_states)
        if carried is None:
            raise ResidualStreamLost(
                f"{path}: the final norm's input was not produced by the last patched decoder layer, so the "
                "engine's fused residual add cannot be reproduced; call it through the model's forward"
            )
        m, r = _Carry.apply(hidden_states, carried)
        out, _ = F.add_rmsnorm(m, r, self.weight, self.variance_epsilon, profile)
        return out

    return forward


# -- apply ----------------------------------------------------------------------------------------


def apply_profile(model: torch.nn.Module, profile: Profile | str, *, skip_native: bool = True) -> PatchHandle:
    """Patch ``model`` (a HF transformers Qwen2/Qwen2.5, Qwen3 or Llama model, possibly wrapped by
    PEFT or FSDP2) in place so that RoPE, SwiGLU and the residual RMSNorm round where ``profile``
    says. ``profile``: a Profile, a path or a shipped name. Returns a :class:`PatchHandle`
    (``remove()`` reverts; also a context manager).

    ``skip_native`` (default): regions where the profile's point is what HF's own module
    computes (:data:`NATIVE`) keep HF's module and its autograd backward; ``False`` runs the
    emulator there too (the same forward bits, the straight-through FP32 backward).

    Refused, with nothing changed: a model of no supported family (or whose modules were
    replaced), a RoPE type other than default, a profile whose dtype is not the model's or that
    records a region as unavailable, a compiled model, a model already patched
    (:class:`AlreadyPatched`: applying twice is an error)."""
    prof = get_profile(profile)
    act = ACT_DTYPES[prof.dtype]
    decoders = _find_decoders(model)
    if not decoders:
        raise UnsupportedModel(
            f"{type(model).__name__} contains no decoder model of a supported family; supported: {_families_text()}"
        )
    families = {d.family.name for d in decoders}
    if len(families) > 1:
        raise UnsupportedModel(f"{type(model).__name__} mixes decoder families ({', '.join(sorted(families))})")
    points = _regions(prof)
    for d in decoders:
        _check_decoder(d)
        _check_dtype(d, prof, act)
    _check_patchable(model, decoders)

    fam = decoders[0].family
    emulate = {r: (not skip_native) or points[r] != REGIONS[r].canonicalize(NATIVE[r]) for r in REGIONS}
    # Qwen3's q/k norms handing FP32 on need the emulator's RoPE, which takes FP32 input.
    qk_fp32 = fam.qk_norm and emulate["rmsnorm"] and points["rmsnorm"]["output"] == FP32
    attention = emulate["rope"] or qk_fp32 or not all(d.inv_freq_exact for d in decoders)
    handle = PatchHandle(
        model, prof, fam,
        emulated=tuple(r for r in REGIONS if emulate[r] or (r == "rope" and attention)),
        native=tuple(r for r in REGIONS if not (emulate[r] or (r == "rope" and attention))),
    )
    try:
        for d in decoders:
            _patch_decoder(handle, d, prof, act, emulate, attention)
    except BaseException:  # pragma: no cover - a bug; leave the model as it was
        handle.remove()
        raise
    return handle


def _patch_decoder(handle: PatchHandle, d: _Decoder, prof: Profile, act: torch.dtype, emulate: dict[str, bool],
                   attention: bool) -> None:
    c, p, layers = d.classes, d.path, d.layers
    _ACTIVE[d.module] = handle
    handle._undo.append(lambda: _ACTIVE.pop(d.module, None))
    guarded: list[torch.nn.Module] = [d.module, *layers]
    if emulate["swiglu"]:
        for i, layer in enumerate(layers):
            handle._bind(f"{p}.layers.{i}.mlp", layer.mlp, _mlp(prof))
            guarded.append(layer.mlp)
    if emulate["rmsnorm"]:
        handle._bind(f"{p}.layers.0.input_layernorm", layers[0].input_layernorm, _norm_plain(prof, act, to_act=True))
        guarded.append(layers[0].input_layernorm)
        if d.family.qk_norm:
            for i, layer in enumerate(layers):
                for n in ("q_norm", "k_norm"):
                    mod = getattr(layer.self_attn, n)
                    handle._bind(f"{p}.layers.{i}.self_attn.{n}", mod, _norm_plain(prof, act, to_act=False))
                    guarded.append(mod)
    if attention:
        handle._bind(f"{p}.rotary_emb", d.module.rotary_emb, _rotary(d.rope_theta, d.rotary_dim))
        for i, layer in enumerate(layers):
            handle._bind(f"{p}.layers.{i}.self_attn", layer.self_attn,
                         _attention(prof, d.family.qk_norm, c["eager_attention"]))
            guarded.append(layer.self_attn)
    if emulate["add_rmsnorm"]:
        stash = _Stash()
        handle._stashes.append(stash)
        for i, layer in enumerate(layers):
            handle._bind(f"{p}.layers.{i}", layer, _layer(prof, stash, layers[0], f"{p}.layers.{i}"))
        handle._bind(f"{p}.norm", d.module.norm, _final_norm(prof, stash, f"{p}.norm"))
        guarded.append(d.module.norm)
        # Drop entries whose hidden state is gone, before and after each forward of the model.
        handle._hook(d.module.register_forward_pre_hook(lambda mod, args: stash.purge()))
        handle._hook(d.module.register_forward_hook(lambda mod, args, out: stash.purge()))
    for mod in guarded:
        handle._hook(mod.register_forward_pre_hook(_compile_guard))


def patched_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """The modules of ``model`` that an active patch has bound a forward on."""
    for name, mod in model.named_modules():
        fwd = mod.__dict__.get("forward")
        if fwd is not None and getattr(getattr(fwd, "__func__", fwd), _PATCHED_ATTR, None) is not None:
            yield name, mod
