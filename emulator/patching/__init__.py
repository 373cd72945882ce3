"""Load a profile into a HF transformers model: ``handle = emulator.apply_profile(model, profile)``.

The patch makes the trainer round where the engine rounds, in the three regions of the rounding
model, by binding per-instance forwards on the model's own modules (found by class on the live
model, so PEFT-wrapped and already-instantiated models work):

* SwiGLU: the MLP computes ``down_proj(swiglu(gate_proj(x), up_proj(x)))``.
* RoPE: the attention applies ``functional.rope`` to q and k with FP32 cos/sin (the rotary
  embedding returns them in FP32, computed from the config's ``rope_parameters`` as
  :class:`engineprofiles.regions.RopeFrequencies` does, as engines do (rope_type default, llama3,
  linear), whatever the dtype of HF's ``inv_freq`` buffer); Qwen3's q/k norms are plain RMSNorm sites, and an FP32 ``output`` is
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
  dtype; FSDP2's hooks re-wrap tensors, so not by identity; while torch.compile traces, by
  identity, with the stash's lookup as the fallback outside the graph). The next layer and the final norm
  look their input up there. An entry lives exactly as long as ``h``'s storage (gradient
  checkpointing keeps it for the recompute); expired entries are dropped. The gradient reaches
  the previous layer through ``h`` (:class:`_Carry`), so reentrant checkpointing and FSDP2's
  post-backward hooks see it where HF's would.

* MoE (Qwen3-MoE, Qwen2-MoE): each sparse MoE block computes its experts with ``functional.moe`` at the
  profile's ``moe`` point (:mod:`emulator.ops.moe`); its router runs as HF's module, and when the
  point keeps ``routing_weight`` FP32 the block hands the router's FP32 top-k weights (before HF's
  cast) to the experts. Dense layers (``mlp_only_layers``) keep the SwiGLU region's patch.
  Qwen2-MoE's sparse blocks also have a gated shared expert: the block's output is
  ``functional.shared_expert`` (the routed output plus the shared term, at the profile's
  ``shared_expert`` point); where that point keeps ``sum`` FP32 the block hands the FP32 sum on, and the
  patched layer's residual path adds it to the residual unrounded (the layers are then patched even
  where the add_rmsnorm point is HF's own).

Regions whose profile point is the one HF's own module computes (:data:`NATIVE`) are left as
they are unless ``skip_native=False``: HF's code already rounds there, and its autograd backward
is kept, so applying the trainer's own profile changes no bit of the outputs or the gradients.
(RoPE is emulated anyway when the model's ``inv_freq`` buffer was rounded by ``model.to(dtype)``,
and under linear scaling, where HF divides the frequencies and the engines the positions.)
Emulated regions use the emulator's straight-through FP32 backward.

All or nothing: every check runs before anything changes; a refused model is untouched.
Applying a profile to a model that is already patched raises :class:`AlreadyPatched` (remove the
first handle, then apply another). ``handle.remove()`` restores the original modules exactly.

torch.compile: ``torch.compile(model)`` of a patched model computes the eager patched model's bits,
forward and backward (:mod:`.guard` says how): the regions and exact mode's attention are custom
ops Inductor calls as opaque operations, the HF code around them whose kernels Inductor would
change (cos/sin, the embedding's gradient, biased linears, HF's attention function, the model's
own loss) runs as opaque ops while traced (:mod:`.opaque`), the residual stream is carried by
identity, and Inductor's ``emulate_precision_casts`` is on while a patch is active. A model
compiled before it is patched recompiles with the patch at its next call. Refused with
:class:`CompileUnsupported`, with a message that says what to do: compiling a patch that leaves a
region to HF's module (``skip_native``; apply with ``skip_native=False`` to compile), gradient
checkpointing under compile, attention implementations other than sdpa/eager (normal mode),
attention dropout, and Inductor with ``emulate_precision_casts`` turned off. After
``handle.remove()`` a compiled model recompiles the plain model.

Exact mode for an engine that compiles its whole model with Inductor (vLLM's CPU build) runs the
decoder stack itself as one torch.compile graph (:func:`.forwards.compiled_stack`): the norms, the
residual adds and the embedding's gather trace inline (the gather's gradient stays eager's), so that
Inductor fuses them, and picks each norm's reduction lanes, as it did in the engine's graph. A
user's torch.compile of such a model traces the same stack into its own graph. Not for a model with
sparse MoE blocks (a patched one runs eagerly): its norms compile one at a time.

Layout: :mod:`.families` (what a family is), :mod:`.carry` (the residual stream between
layers), :mod:`.forwards` (the bound forwards), :mod:`.opaque` (HF's code as opaque ops under
torch.compile), :mod:`.guard` (what torch.compile needs, and its refusals), :mod:`.handle` (the
way back; a deepcopy of a patched model gets its own state and handle), :mod:`.apply` (the checks and
the patch), :mod:`.entry` (class-level patching, ``patch_qwen2(profile)`` before ``from_pretrained``, and
the profile recorded in the model's config).

Mixed precision: the profile's dtype is the compute dtype. FP32 master weights (torch.autocast, FSDP2's
MixedPrecisionPolicy) compute with the norm weights and the embedding rounded to it, bit for bit what
the model stored in that dtype computes; a cast of the residual stream between layers (FSDP2's
cast_forward_inputs) is recognized by value (:mod:`.carry`).
"""

from ..errors import (
    AlreadyPatched,
    CompileUnsupported,
    PatchError,
    ResidualStreamLost,
    UnsupportedModel,
)
from engineprofiles.extras import check_version as _check_version

# transformers older than the floor has no AttentionInterface.get_interface, which the patched attention calls
# (4.57.6 failed mid-patch): refused here, naming the installed version.
_check_version("transformers", "the emulator's model patching (apply_profile, patch_family)")

from .apply import apply_profile  # noqa: E402
from .families import FAMILIES, NATIVE, Family
from .entry import ClassPatch, NoRecordedProfile, apply_recorded_profile, patch_family, recorded_profile
from .handle import PatchHandle, handle_of, patched_modules

__all__ = [
    "apply_profile", "PatchHandle", "FAMILIES", "NATIVE", "Family", "PatchError", "UnsupportedModel", "AlreadyPatched",
    "CompileUnsupported", "ResidualStreamLost", "patched_modules", "handle_of", "ClassPatch", "NoRecordedProfile",
    "apply_recorded_profile", "patch_family", "recorded_profile",
]


def __getattr__(name: str):
    if name.startswith("patch_"):  # patch_qwen2, patch_qwen3, patch_llama, ...: one per family
        from . import entry

        return getattr(entry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
