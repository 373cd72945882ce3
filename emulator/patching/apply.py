"""apply_profile: check everything, then patch; nothing changes before every check passes."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from engineprofiles import engines
from engineprofiles.regions import FP32, REGIONS, Point
from engineprofiles.regions.attention import KVSplit, split_merge
from engineprofiles.rounding import ACT_DTYPES
from engineprofiles.schema import ENTRY_SINCE, Profile
from engineprofiles.store import get_profile, names_engine

from ..errors import (
    AlreadyPatched,
    CapabilityMismatch,
    ExactModeUnavailable,
    InexactEvidence,
    InputError,
    MachineMismatch,
    ProfileMismatch,
    RegionUnavailable,
    UnsupportedModel,
)
from . import forwards as fw
from . import opaque
from .carry import Stash
from .families import NATIVE, Decoder, check_decoder, families_text, find_decoders
from .guard import checkpointing_hook, hold_eager_numerics, native_message, refusal_hook
from .handle import ACTIVE, PATCHED_ATTR, PatchHandle, PatchRecord


def _check_dtype(d: Decoder, profile: Profile, act: torch.dtype) -> bool:
    """Every weight the model computes with must be stored in the profile's dtype, or in FP32 as the
    master weights of mixed precision (torch.autocast, FSDP2's MixedPrecisionPolicy), which the
    forward then computes with in the profile's dtype (PEFT adapter weights, which PEFT keeps in FP32
    and casts its output back, are exempt). Returns whether some weight is stored in FP32."""
    mixed = False
    for name, prm in d.module.named_parameters():
        if any(part.startswith("lora_") for part in name.split(".")):
            continue
        if not prm.is_floating_point() or prm.dtype == act:
            continue
        if prm.dtype == torch.float32:
            mixed = True
            continue
        raise ProfileMismatch(
            f"{d.path}.{name} is {prm.dtype}, but profile {profile.canonical_name} was measured in {profile.dtype}: "
            f"the model must compute in the profile's dtype (load it with dtype=torch.{profile.dtype}, or keep FP32 "
            f"master weights and run under torch.autocast(dtype=torch.{profile.dtype}) or FSDP2's "
            f"MixedPrecisionPolicy(param_dtype=torch.{profile.dtype})), or use a profile probed in {prm.dtype}"
        )
    return mixed


def _check_patchable(model: torch.nn.Module, decoders: list[Decoder]) -> None:
    for d in decoders:
        handle = ACTIVE.get(d.module)
        if handle is None:
            for _, mod in d.module.named_modules():
                fwd = mod.__dict__.get("forward")
                handle = handle or getattr(getattr(fwd, "__func__", fwd), PATCHED_ATTR, None)
        if handle is not None:
            raise AlreadyPatched(
                f"{d.path} is already patched with profile {handle.profile.canonical_name}; applying twice is an "
                "error: call remove() on the first handle (emulator.handle_of(model) returns it, also for a deepcopy of a patched "
                "model, which is patched), then apply the new profile"
            )
        for path, mod in d.module.named_modules():
            if "forward" in mod.__dict__:
                where = f"{d.path}.{path}" if path else d.path
                fwd = mod.__dict__["forward"]
                origin = getattr(getattr(fwd, "__func__", fwd), "__module__", None) or ""
                by = (f"by Liger-Kernel ({origin}: apply_liger_kernel_to_*(model=...) patches instances): Liger and "
                      "the profile both replace the regions, so one would silently override the other; apply the "
                      "profile to a model without Liger's rope/rms_norm/swiglu" if origin.startswith("liger_kernel")
                      else "(accelerate hooks or another patch)")
                raise UnsupportedModel(
                    f"{where} ({type(mod).__name__}) already has a per-instance forward {by}; apply_profile binds its "
                    "own forwards and would discard it"
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


def _block_point(profile: Profile, entry: str, blocks: list[str], what: str, computes: str) -> Point | None:
    """The profile's point for ``entry`` (beside the regions) when the model has the sparse MoE
    ``blocks`` it concerns (None when it has none: the entry does not affect the model); refused
    when the profile has none measured."""
    if not blocks:
        return None
    if not profile.available(entry):
        more = f" and {len(blocks) - 1} more" if len(blocks) > 1 else ""
        raise RegionUnavailable(
            f"profile {profile.canonical_name} has no measured {entry} entry ({profile.entry(entry).evidence.reason}), "
            f"and the model has {what} ({blocks[0]}{more}) whose {computes} the patch computes at the profile's "
            f"{entry} point; so it changes nothing: use a profile in which {entry} was measured (schema version "
            f"{ENTRY_SINCE[entry]} or later, probed with this version of engineprofiles)"
        )
    return profile.point(entry)


def _moe_point(profile: Profile, decoders: list[Decoder]) -> Point | None:
    """The ``moe`` point for a model with sparse MoE blocks (their routed experts)."""
    blocks = [f"{d.path}.layers.{i}.mlp" for d in decoders for i in d.sparse]
    return _block_point(profile, "moe", blocks, "sparse MoE blocks", "experts")


def _shared_point(profile: Profile, decoders: list[Decoder]) -> Point | None:
    """The ``shared_expert`` point for a model whose sparse MoE blocks have a shared expert (Qwen2-MoE)."""
    blocks = [f"{d.path}.layers.{i}.mlp" for d in decoders if d.family.shared_expert for i in d.sparse]
    return _block_point(profile, "shared_expert", blocks, "sparse MoE blocks with a shared expert",
                        "shared expert and sum with the routed experts")


def _check_machine(model: torch.nn.Module, profile: Profile, allow_other_machine: bool) -> None:
    """Exact mode claims the engine's bits, which follow the machine's kernels (attention ISA, GEMM
    path, vector ISA): refused (:class:`ExactModeUnavailable`) where this machine is not the one the
    profile records, or the model is on another device type than the profile was probed on;
    ``allow_other_machine`` makes it a :class:`MachineMismatch` warning."""
    import warnings

    from engineprofiles.machine import Machine, differences, probe_command, this_machine

    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    if dev.type != profile.engine.backend:
        diffs = [f"device: profile probed on {profile.engine.backend}, the model is on {dev.type}"]
        recorded, here = None, None
    elif dev.type == "cpu":
        recorded, here = Machine.of(profile.engine.settings), this_machine()
        diffs = differences(recorded, here)
    else:  # GPU machines are not described yet: the device check above is all there is
        diffs, recorded, here = [], None, None
    if not diffs:
        _check_rows(model, profile, allow_other_machine)
        return
    what = (f"profile {profile.canonical_name} was probed on {profile.engine.device}"
            + (f" ({recorded.describe()})" if recorded is not None else "")
            + (f"; this machine is {here.describe()}" if here is not None else "")
            + f". What differs: {'; '.join(diffs)}. The engine's kernels (attention ISA, GEMM path, vector ISA) "
              "follow the machine, so exact mode would not reproduce its bits here")
    if allow_other_machine:
        warnings.warn(what + " (allow_other_machine=True: exact mode runs the profile's point anyway)",
                      MachineMismatch, stacklevel=5)
        return
    raise ExactModeUnavailable(
        what + f". Probe the engine on this machine (`{probe_command(profile.engine.name)}`, or "
        f"`probe-engine {profile.engine.name}` in its environment) and apply that profile, or pass "
        "allow_other_machine=True to run the profile's point with a warning; nothing was changed")


def _check_rows(model: torch.nn.Module, profile: Profile, allow_other_machine: bool) -> None:
    """Exact mode scores many tokens in one forward (a padded batch, a whole sequence) where the engine
    computed each in its own batch; that gives the engine's bits only where this machine's linear layers
    give a row the same bits whatever the number of rows (:mod:`emulator.patching.gemm`, measured here
    on the model's own shapes). Said (InexactEvidence) otherwise: the engine's own token batching still
    reproduces it (measured: K=4864 on the AMD EPYC varies, and decoding token by token stays exact)."""
    import warnings

    from .gemm import row_variant_linears

    bad = row_variant_linears(model, ACT_DTYPES[profile.dtype])
    if not bad:
        return
    warnings.warn(
        f"on this machine the model's linear layers give a token other bits depending on how many tokens share the "
        f"GEMM ({'; '.join(bad[:3])}{f'; and {len(bad) - 3} more' if len(bad) > 3 else ''}): exact mode reproduces "
        "the engine only where a forward has the engine's token batching (a prompt as the engine prefilled it, each "
        "decode step alone); a padded batch or a prompt scored with its completion will not", InexactEvidence,
        stacklevel=6)


def _check_exact(model: torch.nn.Module, decoders: list[Decoder], profile: Profile,
                 allow_other_machine: bool = False) -> Point:
    """Exact mode's own refusals (before anything changes): attention unmeasured, sliding windows,
    dropout, another machine than the profile's (:func:`_check_machine`)."""
    import warnings

    if not profile.available("attention"):
        raise ExactModeUnavailable(
            f"exact mode needs the engine's attention, and profile {profile.canonical_name} has none measured "
            f"({profile.attention.evidence.reason}); use a profile probed with attention (schema version 2: "
            "`probe-engine vllm` in situ, or the shipped in-situ profiles), or apply without exact=True"
        )
    for d in decoders:
        for i, layer in enumerate(d.layers):
            attn = layer.self_attn
            if d.family.sliding_window(attn):
                raise ExactModeUnavailable(f"{d.path}.layers.{i}.self_attn uses sliding-window attention, which exact "
                                           "mode does not reproduce (the attention lattice is causal, full window)")
            if float(getattr(attn, "attention_dropout", 0.0) or 0.0) != 0.0:
                raise ExactModeUnavailable(f"{d.path}.layers.{i}.self_attn has attention dropout "
                                           f"{attn.attention_dropout}; the engine has none, so exact mode refuses it "
                                           "(set config.attention_dropout = 0.0)")
    sc = profile.provenance.self_check
    if sc is not None and not sc.exact:
        warnings.warn(
            f"profile {profile.canonical_name}: its self-check, on a model of widths the fit never saw ({sc.model}), "
            f"did not reproduce every token in exact mode ({sc.rows()}): exact mode may not be bit-exact on this "
            "model's widths either; `probe-engine mismatch ENGINE --exact` with the model's widths measures it",
            InexactEvidence, stacklevel=4)
    check_attention_evidence(profile)
    _check_machine(model, profile, allow_other_machine)
    return profile.point("attention")


def check_attention_evidence(profile: Profile) -> None:
    """Exact mode fails closed on a profile whose attention point did not reproduce every probed element of the
    engine's kernel: ExactModeUnavailable, naming the rate (before any model is touched)."""
    rate = profile.attention.evidence.match_rate
    if rate is not None and rate < 1.0:  # exact mode would compute a point known to differ
        raise ExactModeUnavailable(
            f"profile {profile.canonical_name}: its attention point matched the engine on {rate:.4%} of the probed "
            f"elements, not all (max {profile.attention.evidence.max_ulp} ULP): exact mode would compute that point "
            "and cannot be bit-exact to this engine, so it refuses. The regions alone: apply_profile(model, profile) "
            "without exact=True; the engine's kernel is outside the attention lattice (docs/exact-mode.md)")


def _check_device(model: torch.nn.Module, profile: Profile) -> None:
    """A profile probed on another device than the model's: a warning (its sites are semantics that
    hold on any device, but the engine on the model's device may round elsewhere)."""
    import warnings

    from engineprofiles.store import _device_type

    dev = _model_device(model)
    if dev is None:
        return
    here = _device_type(dev)
    if here != profile.engine.backend:
        warnings.warn(
            f"profile {profile.canonical_name} was probed on {profile.engine.backend}, the model is on {here}: the patch "
            f"reproduces that engine's rounding on {profile.engine.backend}, and the engine on {here} may round "
            f"elsewhere. Probe the engine on {here} (probe-engine ENGINE --device {here}) and apply that profile, or "
            "choose by engine name (apply_profile(model, 'vllm')); warnings.simplefilter('error', CapabilityMismatch) "
            "makes this an error", CapabilityMismatch, stacklevel=5)


def _model_dtype(model: torch.nn.Module) -> str | None:
    """The dtype the model computes in (its first floating-point weight that is not a PEFT
    adapter's), as a profile names it; None for a model without one. FP32 weights are mixed
    precision's master weights: the compute dtype is autocast's when it is active here, else None
    (unknown: choosing by engine name prefers bfloat16)."""
    for name, prm in model.named_parameters():
        if prm.is_floating_point() and not any(part.startswith("lora_") for part in name.split(".")):
            if prm.dtype == torch.float32:
                dev = prm.device.type
                if dev != "meta" and torch.is_autocast_enabled(dev):
                    return str(torch.get_autocast_dtype(dev)).removeprefix("torch.")
                return None
            return str(prm.dtype).removeprefix("torch.")
    return None


def _model_device(model: torch.nn.Module) -> torch.device | None:
    """Where the model's weights are; None when unknown (no weights, or the meta device, which
    apply_profile refuses later)."""
    dev = next((p.device for p in model.parameters()), None)
    return None if dev is None or dev.type == "meta" else dev


def apply_profile(model: torch.nn.Module, profile: Profile | str, *, skip_native: bool = True,
                  exact: bool = False, record: bool = False, kv_split: KVSplit | int | None = None,
                  allow_other_machine: bool = False, kernels: str = "auto") -> PatchHandle:
    """Patch ``model`` (a HF transformers Qwen2/Qwen2.5, Qwen3, Llama, Mistral, Qwen3-MoE or Qwen2-MoE model, possibly
    wrapped by PEFT or FSDP2) in place so that RoPE, SwiGLU and the residual RMSNorm round where ``profile``
    says; a MoE model's experts (and Qwen2-MoE's shared expert with its sum) compute at the profile's ``moe``
    (``shared_expert``) point, always emulated, eagerly (compiling it is refused); a profile without them
    measured is refused (:class:`RegionUnavailable`); docs/concepts.md has the details.
    ``profile``: a Profile, a path, a shipped name, or an engine: ``"vllm"``,
    ``"vllm==0.32.0"``, ``"vllm:eager"`` (``ENGINE[==VERSION][:MODE]``; the shipped profile that
    fits this model best: the installed engine version, else the newest; the engine's default mode
    unless another is asked; the model's dtype and device; this CPU's capability; in situ over
    op-level. :func:`engineprofiles.store.choose` logs the choice and warns
    (``VersionMismatch``, ``CapabilityMismatch``) when only a mismatched profile exists; see
    :mod:`engineprofiles.select`). Returns a :class:`PatchHandle` (``remove()`` reverts; also a
    context manager).

    ``skip_native`` (default): regions where the profile's point is what HF's own module
    computes (:data:`NATIVE`) keep HF's module and its autograd backward; ``False`` runs the
    emulator there too (the same forward bits, the straight-through FP32 backward).

    Mixed precision: the profile's dtype is the compute dtype. FP32 master weights are accepted
    (``torch.autocast(dtype=torch.bfloat16)`` over FP32 weights, FSDP2's
    ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``, with or without ``cast_forward_inputs``):
    the regions then compute with the weights rounded to the profile's dtype and the embedding
    rounded as the engine stores it, bit for bit what the model stored in that dtype computes, and
    every region is emulated (``skip_native`` does not apply: HF's own modules do not round as the
    profile's point with FP32 weights). A forward that would compute in FP32 (FP32 weights, no
    autocast to the profile's dtype) raises :class:`~emulator.errors.ProfileMismatch`.

    ``record=True`` writes the profile (its YAML) and these options into ``model.config.emulator_profile``,
    which ``save_pretrained`` saves; :func:`emulator.apply_recorded_profile` (or a class patch without a
    profile, :func:`emulator.patch_family`) applies it to the loaded model. ``remove()`` takes it out.

    A profile probed on another device than the model's (a CPU profile on a CUDA model) is a
    :class:`~engineprofiles.errors.CapabilityMismatch` warning (the sites are device-independent
    semantics; the engine on the model's device may round elsewhere): re-probe there, or turn the
    warning into an error with ``warnings.simplefilter("error", CapabilityMismatch)``.

    Refused, with nothing changed: a model of no supported family (or whose modules were
    replaced), a model on the meta device (no weights yet), a RoPE type other than default, a profile whose dtype is not the model's (nor FP32 master weights') or that
    records a region as unavailable, a model already patched (:class:`AlreadyPatched`: applying
    twice is an error).

    ``torch.compile(model)`` of the patched model computes the same bits as the eager patched
    model, forward and backward; what it refuses, and the process-wide Inductor setting a patch
    holds, are in :mod:`emulator.patching.guard`.

    ``exact=True`` (exact mode): attention too is computed as the profile's engine computes it
    (the profile's ``attention`` entry, prefill and decode), so that with the regions and HF's own
    matmuls the forward reproduces the engine's log-probs bit for bit where the profile's evidence
    says it can. Refused (:class:`ExactModeUnavailable`, nothing changed) for a profile without
    measured attention, sliding-window attention or attention dropout, and where this machine is not
    the one the profile records (:mod:`engineprofiles.machine`: CPU vendor, vector ISA, AMX and the
    other kernel-selecting features; a profile that records none; a model on another device type than
    the profile's), since the engine's kernels follow the machine, and where this machine's linear
    layers give a token other bits depending on the number of tokens in the GEMM (measured on the
    model's own shapes: :mod:`emulator.patching.gemm`) it warns (:class:`InexactEvidence`): only the
    engine's own token batching reproduces it then. ``allow_other_machine=True`` turns the machine
    refusal into a :class:`MachineMismatch` warning and runs the profile's point anyway.

    ``kv_split`` (exact mode, a vLLM CPU profile): the engine ran with ``VLLM_CPU_ATTN_SPLIT_KV=1``
    (vLLM's default) and this many OpenMP threads (an int, or a
    :class:`engineprofiles.regions.attention.KVSplit`): attention computes each batch row as vLLM
    computes one request alone, splitting the keys of a last query tile of one token (every decode
    step) across the threads as its scheduler does and merging the chunks as its kernel does (an int: as the
    profile's kernel, ``split_merge``). The split depends on the call's shape: a forward of one query over a KV
    cache reproduces a decode step; a forward of the whole sequence reproduces the engine's prefill of it. None (default): no
    row is split (``VLLM_CPU_ATTN_SPLIT_KV=0``, or one thread).

    ``kernels`` (exact mode's attention): ``"engine"`` runs the profile's engine's own attention kernel
    where that engine is importable in this process (TRL's colocate mode, verl's hybrid engine) and picks
    the kernel the profile recorded (its attention ISA, its version), else refuses
    (:class:`ExactModeUnavailable`, nothing changed); ``"portable"`` the bit-portable reference the probe
    fits; ``"auto"`` (default) the engine's kernel where it can, else the reference, logging why. The
    handle's ``kernels`` says which runs. Rows scored as sampled together in a batch (``as_sampled`` with
    completion lengths) take the reference either way; the backward is the same (FP32 attention's)."""
    plan = plan_patch(model, profile, skip_native=skip_native, exact=exact, record=record, kv_split=kv_split,
                      allow_other_machine=allow_other_machine, kernels=kernels)
    return _apply_plan(model, plan)


@dataclass
class PatchPlan:
    """Every decision of a patch, computed once from one resolved profile and the live model, before
    anything changes (:func:`plan_patch`); :func:`_apply_plan` carries it out. ``emulate``: per region,
    whether the emulator's forward replaces HF's; ``attention``: whether the attention forward is bound
    (for the emulator's RoPE, exact mode or mixed precision); ``points``: the regions' points as the
    profile writes them."""

    profile: Profile
    act: torch.dtype
    decoders: list[Decoder]
    points: dict[str, Point]
    emulate: dict[str, bool]
    attention: bool
    emulated: tuple[str, ...]
    native: tuple[str, ...]
    exact: bool
    skip_native: bool
    record: bool
    exact_point: Point | None = None
    moe_point: Point | None = None
    shared_point: Point | None = None
    kv_split: KVSplit | None = None
    norm_backend: str | None = None
    kernels: str = ""  # exact mode's attention: the engine whose kernel runs it ("": the portable reference)
    kernels_option: str = "auto"  # what apply_profile was asked (recorded in the config with record=True)


def _kv_split_of(kv_split: KVSplit | int | None, exact: bool) -> KVSplit | int | None:
    """``kv_split`` checked; a thread count stays an int (its KVSplit takes the merge of the profile's kernel)."""
    if kv_split is None:
        return None
    if isinstance(kv_split, int) and not isinstance(kv_split, bool):
        if kv_split < 1:
            raise InputError(f"apply_profile: kv_split is the engine's thread count, a positive integer; got {kv_split}")
    elif not isinstance(kv_split, KVSplit):
        raise InputError(f"apply_profile: kv_split must be the engine's thread count (int), a KVSplit or None; "
                         f"got {type(kv_split).__name__}")
    if not exact:
        raise InputError("apply_profile: kv_split is part of exact mode's attention; pass exact=True with it")
    return kv_split


def _resolve(model: torch.nn.Module, profile: Profile | str) -> tuple[Profile, list[Decoder]]:
    """The profile (a shipped name or engine spec chosen for the model's dtype and device) and the
    model's decoders, all of one supported family."""
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedModel(
            f"apply_profile patches a model (a torch.nn.Module: a HF transformers {families_text()}); "
            f"got {type(model).__name__}"
        )
    if isinstance(profile, Point) or not isinstance(profile, (Profile, str, os.PathLike)):
        hint = " (a lattice Point is one region's rounding: emulator.functional takes it)" if isinstance(profile, Point) else ""
        raise ProfileMismatch(f"apply_profile needs a Profile, a path or a shipped name; got {type(profile).__name__}{hint}")
    prof = get_profile(profile, dtype=_model_dtype(model), device=_model_device(model))
    if not (isinstance(profile, str) and names_engine(profile)):  # (choosing by engine name warns itself)
        _check_device(model, prof)
    decoders = find_decoders(model)
    if not decoders:
        raise UnsupportedModel(
            f"{type(model).__name__} contains no decoder model of a supported family; supported: {families_text()}"
        )
    families = {d.family.name for d in decoders}
    if len(families) > 1:
        raise UnsupportedModel(f"{type(model).__name__} mixes decoder families ({', '.join(sorted(families))})")
    return prof, decoders


def plan_patch(model: torch.nn.Module, profile: Profile | str, *, skip_native: bool = True, exact: bool = False,
               record: bool = False, kv_split: KVSplit | int | None = None,
               allow_other_machine: bool = False, kernels: str = "auto") -> PatchPlan:
    """Every check of :func:`apply_profile` and every decision it takes, with nothing changed: the
    :class:`PatchPlan` (what would be emulated, native, bound), or the refusal it would raise."""
    kv_split = _kv_split_of(kv_split, exact)
    if kernels not in KERNELS:
        raise InputError(f"apply_profile: kernels must be one of {', '.join(KERNELS)}; got {kernels!r}")
    if kernels == "engine" and not exact:
        raise InputError("apply_profile: kernels='engine' runs exact mode's attention in the engine's kernel; pass "
                         "exact=True with it")
    if allow_other_machine and not exact:
        raise InputError("apply_profile: allow_other_machine concerns exact mode's claim on this machine; pass "
                         "exact=True with it (the regions alone make no claim about the machine)")
    prof, decoders = _resolve(model, profile)
    act = ACT_DTYPES[prof.dtype]
    points = _regions(prof)
    mixed = False
    for d in decoders:
        check_decoder(d, prof.engine.name)
        mixed = _check_dtype(d, prof, act) or mixed
    moe_point = _moe_point(prof, decoders)
    shared_point = _shared_point(prof, decoders)
    _check_patchable(model, decoders)
    exact_point = _check_exact(model, decoders, prof, allow_other_machine) if exact else None
    if isinstance(kv_split, int):  # the engine's thread count: the split merges as the profile's kernel does
        kv_split = KVSplit(threads=kv_split, merge=split_merge(exact_point))
    eng = engines.ENGINES.get(prof.engine.name)
    if kv_split is not None and (eng is None or not eng.split_kv or prof.engine.backend != "cpu"):
        raise ExactModeUnavailable(
            f"kv_split models vLLM's CPU attention scheduler (an engine whose record has split_kv); profile "
            f"{prof.canonical_name} is of "
            f"{prof.engine.name} on {prof.engine.backend}")
    engine_kernels = _engine_kernels(model, decoders, prof, act, kernels) if exact else ""
    fam = decoders[0].family
    # FP32 master weights (mixed precision): HF's own modules do not round as with weights stored in the
    # activation dtype (e.g. its norm multiplies by the FP32 weight), so every region is emulated.
    emulate = {r: mixed or (not skip_native) or points[r] != REGIONS[r].canonicalize(NATIVE[r]) for r in REGIONS}
    if shared_point is not None and shared_point["sum"] == FP32:
        # The sparse blocks hand their output on in FP32: only the patched layer's residual path (the
        # add fused into the next norm) takes it unrounded; HF's layer would add it in FP32 and return that.
        emulate["add_rmsnorm"] = True
    beside = (("moe",) if moe_point is not None else ()) + (("shared_expert",) if shared_point is not None else ())
    # Qwen3's q/k norms handing FP32 on need the emulator's RoPE, which takes FP32 input.
    qk_fp32 = fam.qk_norm and emulate["rmsnorm"] and points["rmsnorm"]["output"] == FP32
    attention = emulate["rope"] or qk_fp32 or not all(d.inv_freq_exact for d in decoders) or exact or mixed
    # Exact mode for an engine that compiled its regions with Inductor: the norms' FP32 reduction
    # in Inductor's order (the other regions have none). On CPU, where that engine ran.
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    norm_backend = "reference-inductor" if exact and prof.engine.execution_mode == "inductor" and on_cpu else None
    if norm_backend:
        emulate = dict(emulate, rmsnorm=True, add_rmsnorm=True)
    emulated = tuple(r for r in REGIONS if emulate[r] or (r == "rope" and attention))
    return PatchPlan(
        profile=prof, act=act, decoders=decoders, points={r: prof.point(r) for r in REGIONS}, emulate=emulate,
        attention=attention, emulated=emulated + (("attention",) if exact else ()) + beside,
        native=tuple(r for r in REGIONS if r not in emulated), exact=exact, skip_native=skip_native, record=record,
        exact_point=exact_point, moe_point=moe_point, shared_point=shared_point, kv_split=kv_split,
        norm_backend=norm_backend, kernels=engine_kernels, kernels_option=kernels)


KERNELS = ("auto", "engine", "portable")


def _engine_kernels(model: torch.nn.Module, decoders: list[Decoder], prof: Profile, act: torch.dtype,
                    kernels: str) -> str:
    """The engine whose own attention kernel exact mode runs (its name, its kernel loaded into
    ``ops.attention.ENGINE_KERNELS``), or "" for the portable reference: ``kernels`` "portable"; "auto"
    where the engine's kernel cannot run here (logged); "engine" refuses then."""
    if kernels == "portable":
        return ""
    why = _engine_kernel_unavailable(model, decoders, prof, act)
    if why is None:
        return prof.engine.name
    if kernels == "engine":
        raise ExactModeUnavailable(f"kernels='engine': {why}; use kernels='portable' (the reference the probe fits)")
    logging.getLogger("emulator").info("exact mode runs the portable attention reference: %s", why)
    return ""


def _engine_kernel_unavailable(model: torch.nn.Module, decoders: list[Decoder], prof: Profile,
                               act: torch.dtype) -> str | None:
    """Why the profile's engine's attention kernel cannot run exact mode's attention here (None: it can,
    and it is loaded)."""
    from engineprofiles.store import installed_version

    from ..ops.attention import ENGINE_KERNELS

    e = prof.engine
    eng = engines.ENGINES.get(e.name)
    if eng is None or eng.exact_attention is None or eng.attention_isa is None:
        return f"no engine kernel is known for {e.name}"
    if e.backend != "cpu" or any(p.device.type != "cpu" for p in model.parameters()):
        return f"{e.name}'s attention kernel here is its CPU one (profile backend {e.backend}, the model's device)"
    here = installed_version(e.name)
    if here is None:
        return f"{e.name} is not installed in this process's environment"
    if here.split("+")[0] != e.version.split("+")[0]:
        return f"{e.name} {here} is installed here, the profile is of {e.version}"
    try:
        fn, isa_of = eng.load("exact_attention"), eng.load("attention_isa")
        head_dims = {int(getattr(layer.self_attn, "head_dim")) for d in decoders for layer in d.layers}
        isas = {isa_of(act, hd) for hd in head_dims}
    except Exception as err:  # an engine that does not import or run here: the reference takes over
        return f"{e.name}'s attention kernel does not load here ({type(err).__name__}: {err})"
    recorded = e.settings.get("attention_isa")
    if recorded is None or isas != {recorded}:
        return (f"{e.name} picks attention ISA {', '.join(sorted(isas))} here for this model, the profile records "
                f"{recorded or 'none'}")
    ENGINE_KERNELS[e.name] = fn
    return None


def _apply_plan(model: torch.nn.Module, plan: PatchPlan) -> PatchHandle:
    """Carry out ``plan``: bind the forwards of every decoder, hook what must be refused or checked,
    and record the patch; a failure part way leaves the model as it was."""
    prof = plan.profile
    handle = PatchHandle(model, prof, plan.decoders[0].family, emulated=plan.emulated, native=plan.native)
    handle.exact, handle.kv_split, handle.skip_native = plan.exact, plan.kv_split, plan.skip_native
    handle.kernels = ("engine" if plan.kernels else "portable") if plan.exact else ""
    handle.kernels_option = plan.kernels_option
    handle.norm_backend = plan.norm_backend
    try:
        for d in plan.decoders:
            _patch_decoder(handle, d, plan.points, plan.act, plan.emulate, plan.attention, plan.exact_point,
                           plan.norm_backend, plan.moe_point, plan.shared_point, plan.kv_split, plan.kernels)
            if handle.native:  # torch.compile is refused (guard.py), wherever it starts; eagerly nothing more is needed
                refuse = refusal_hook(native_message(handle.native, prof.canonical_name))
                for mod in _region_modules(d):
                    handle._hook(mod.register_forward_pre_hook(refuse), refuse)
                losses = []
            else:
                losses = _patch_loss(handle, model, d)
                hook = checkpointing_hook(d.path)
                handle._hook(d.module.register_forward_pre_hook(hook), hook)
            handle._set(d.module, "_emulator_patch", PatchRecord(handle, d.module, model, losses))
            inside = {id(m) for m in d.module.modules()}
            handle._set(d.module, "_emulator_bound", [b for b in handle._bound if id(b[1]) in inside])
            handle._hook(d.module.register_forward_pre_hook(_check_bound), _check_bound)
        if not handle.native:
            handle._undo.append(hold_eager_numerics())
            handle._holds_numerics = True
        if plan.record:
            from .entry import record as record_in_config

            record_in_config(handle)
    except BaseException:  # pragma: no cover - a bug; leave the model as it was
        handle.remove()
        raise
    return handle


def _patch_decoder(handle: PatchHandle, d: Decoder, points: dict[str, Point], act: torch.dtype,
                   emulate: dict[str, bool], attention: bool, exact_point: Point | None = None,
                   norm_backend: str | None = None, moe_point: Point | None = None,
                   shared_point: Point | None = None, kv_split: KVSplit | None = None, kernels: str = "") -> None:
    c, p, layers = d.classes, d.path, d.layers
    ACTIVE[d.module] = handle
    handle._undo.append(lambda: ACTIVE.pop(d.module, None))
    emb = getattr(d.module, "embed_tokens", None)
    if not handle.native and emb is not None:  # (with native regions compiling is refused anyway)
        if opaque.plain_embedding(emb):
            handle._bind(f"{p}.embed_tokens", emb, fw.embedding(inline=bool(norm_backend)))
        else:
            refuse = refusal_hook(
                f"{p}.embed_tokens is a {type(emb).__name__}, not a plain torch.nn.Embedding; compiled, its gradient "
                "would be Inductor's scatter-add, not eager's, so a patched model with it cannot be compiled: run "
                "it eagerly")
            handle._hook(d.module.register_forward_pre_hook(refuse), refuse)
    if emulate["swiglu"]:
        for i, layer in enumerate(layers):
            if i not in d.sparse:  # a dense MLP (a sparse MoE block's experts are the moe entry's)
                handle._bind(f"{p}.layers.{i}.mlp", layer.mlp,
                             fw.mlp(points["swiglu"], act, f"{p}.layers.{i}.mlp", handle.profile.canonical_name))
    if moe_point is not None:
        for i in d.sparse:
            handle._bind(f"{p}.layers.{i}.mlp", layers[i].mlp,
                         fw.moe_block(moe_point, act, f"{p}.layers.{i}.mlp", handle.profile.canonical_name,
                                      shared=shared_point if d.family.shared_expert else None))
    if emulate["rmsnorm"]:
        handle._bind(f"{p}.layers.0.input_layernorm", layers[0].input_layernorm,
                     fw.norm_plain(points["rmsnorm"], act, to_act=True, backend=norm_backend))
        if d.family.qk_norm:
            for i, layer in enumerate(layers):
                for n in ("q_norm", "k_norm"):
                    mod = getattr(layer.self_attn, n)
                    handle._bind(f"{p}.layers.{i}.self_attn.{n}", mod,
                                 fw.norm_plain(points["rmsnorm"], act, to_act=False, backend=norm_backend))
    if attention:
        handle._bind(f"{p}.rotary_emb", d.module.rotary_emb, fw.rotary(d.rope))
        for i, layer in enumerate(layers):
            handle._bind(f"{p}.layers.{i}.self_attn", layer.self_attn,
                         fw.attention(points["rope"], act, d.family.qk_norm, c["eager_attention"], d.family.name,
                                      f"{p}.layers.{i}.self_attn", exact_point, rope=d.rope, kv_split=kv_split,
                                      profile_name=handle.profile.canonical_name, kernels=kernels))
    if emulate["add_rmsnorm"]:
        # The residual stream's state lives on the modules (a deepcopy of the model gets its own).
        stash = Stash()
        handle._stashes.append(stash)
        handle._set(d.module, "_emulator_stash", stash)
        handle._set(d.module.norm, "_emulator_stash", stash)
        for i, layer in enumerate(layers):
            handle._set(layer, "_emulator_stash", stash)
            handle._set(layer, "_emulator_first", i == 0)
            handle._bind(f"{p}.layers.{i}", layer, fw.layer(points["add_rmsnorm"], act, f"{p}.layers.{i}", norm_backend,
                                                      handle.profile.canonical_name))
        handle._bind(f"{p}.norm", d.module.norm, fw.final_norm(points["add_rmsnorm"], act, f"{p}.norm", norm_backend))
        # Drop entries whose hidden state is gone, before and after each forward of the model.
        pre, post = _purge_pre, _purge_post
        handle._hook(d.module.register_forward_pre_hook(pre), pre)
        handle._hook(d.module.register_forward_hook(post), post)
    if norm_backend and not handle.native and not d.sparse:
        # An engine that compiles its whole model: the stack runs as one Inductor graph (see fw.compiled_stack).
        # (Not with sparse MoE blocks: a patched one runs eagerly, a graph break; the norms then compile alone.)
        handle._bind(p, d.module, fw.compiled_stack(type(d.module).forward))


def _check_bound(mod: torch.nn.Module, args: object) -> None:
    """Before each forward of a patched decoder: the forwards the patch bound are still there. A
    kernel library patching instances afterwards (Liger's ``apply_liger_kernel_to_*(model=...)``)
    replaces them, and the region would silently run its code instead of the profile's."""
    for path, m, fn in mod._emulator_bound:
        fwd = m.__dict__.get("forward")
        if getattr(fwd, "__func__", None) is not fn:
            _replaced(path, getattr(getattr(fwd, "__func__", fwd), "__module__", None) or "the class's own forward")


def _replaced(path: str, origin: str) -> None:
    # Raised outside traced code (disabled below), so that torch.compile reports this error, not Dynamo's own.
    raise UnsupportedModel(
        f"{path}: its forward was replaced after apply_profile patched it (now {origin}), so the profile's region "
        "no longer runs there. Do not apply other kernel patches (e.g. Liger-Kernel's rope, rms_norm or swiglu) to "
        "a patched model: remove the patch first (handle.remove()) and choose one of the two"
    )


try:
    _replaced = torch.compiler.disable(_replaced, reason="UnsupportedModel: a forward bound by apply_profile was "
                                       "replaced (e.g. by Liger-Kernel's instance patch); run eagerly to see which")
except TypeError:  # pragma: no cover - a torch whose disable takes no reason (before 2.8)
    _replaced = torch.compiler.disable(_replaced)


def _purge_pre(mod: torch.nn.Module, args: object) -> None:
    mod._emulator_stash.purge()


def _purge_post(mod: torch.nn.Module, args: object, out: object) -> None:
    mod._emulator_stash.purge()


def _patch_loss(handle: PatchHandle, model: torch.nn.Module, d: Decoder) -> list[tuple[str, bool, object]]:
    """The causal LM around ``d`` computes its own loss (HF's ForCausalLMLoss) as eager torch does,
    also when compiled (see :mod:`.opaque`); a model with another loss function keeps it. Returns
    (path, had, before) of each module it changed (for a deepcopy's handle)."""
    changed = []
    for path, mod in model.named_modules():
        if getattr(mod, "model", None) is not d.module:
            continue
        if not isinstance(getattr(type(mod), "loss_function", None), property):
            continue
        if mod.loss_function is not opaque.hf_loss():
            continue
        had = "_loss_function" in mod.__dict__
        before = mod.__dict__.get("_loss_function")
        fn = opaque.loss_function()
        setattr(fn, PATCHED_ATTR, handle)
        mod._loss_function = fn
        changed.append((path, had, before))

        def undo(mod: torch.nn.Module = mod, had: bool = had, before: object = before) -> None:
            if had:
                mod.__dict__["_loss_function"] = before
            else:
                mod.__dict__.pop("_loss_function", None)

        handle._undo.append(undo)
    return changed


def _region_modules(d: Decoder) -> list[torch.nn.Module]:
    """The decoder and the modules of it that compute a region (and so HF's rounding, when native)."""
    mods: list[torch.nn.Module] = [d.module, d.module.norm, d.module.rotary_emb]
    for layer in d.layers:
        mods += [layer, layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm]
        if d.family.qk_norm:
            mods += [layer.self_attn.q_norm, layer.self_attn.k_norm]
    return mods
