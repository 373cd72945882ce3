"""The engine-agnostic probe: feed the engine's region implementations discriminating inputs,
compare bitwise against every lattice point, pick the winner, and record the evidence.

Nothing is silently resolved: two points matching equally (ambiguous), a winner that changes
with shape (shape dependent) and two identical runs that differ (nondeterministic) are flagged in
the evidence. Points that differ only in formula variants and computed the same bits on every
input are reported as not told apart, which is not an ambiguity about rounding sites.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .. import PROBE_VERSION, __version__
from ..regions import (BESIDE, REGIONS, Point, RegionSpec, add_rmsnorm_ref, moe_block_ref, rmsnorm_ref, rope_cos_sin,
                       rope_ref, shared_expert_ref, swiglu_ref)
from ..regions.moe import GemmMemo
from ..errors import EngineProfilesError
from ..rounding import act_dtype, dtype_name, ulp_distance
from ..schema import Evidence, Profile, make_profile
from .base import Adapter, RegionImpl, Unavailable
from .inputs import Case, cases, make_inputs

Progress = Callable[[str], None]


_REF_CACHE: dict[tuple, tuple[torch.Tensor, ...]] = {}


def cached_reference_outputs(region: str, p: Point, inp: dict[str, Any], key: tuple) -> tuple[torch.Tensor, ...]:
    """reference_outputs, memoized per probe case (inputs are a function of case, dtype and seed)."""
    k = (region, p, key)
    if k not in _REF_CACHE:
        if len(_REF_CACHE) > 20000:
            _REF_CACHE.clear()
        _REF_CACHE[k] = reference_outputs(region, p, inp)
    return _REF_CACHE[k]


def spec_of(region: str) -> RegionSpec:
    """The spec of a region or of an entry probed the same way beside them (``moe``, ``shared_expert``)."""
    return REGIONS[region] if region in REGIONS else BESIDE[region]


def _rope_reference(p: Point, inp: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    cos, sin = rope_cos_sin(inp["positions"], inp["q"].shape[-1], inp["base"])
    return rope_ref(inp["q"], cos, sin, p, style=inp["style"]), rope_ref(inp["k"], cos, sin, p, style=inp["style"])


def _moe_reference(p: Point, inp: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    # one GEMM memo per probe case: every lattice point is evaluated on the case's same tensors
    memo = inp.setdefault("gemm_memo", GemmMemo())
    return (moe_block_ref(inp["x"], inp["w13"], inp["w2"], inp["router_logits"], inp["topk"], p,
                          renormalize=inp["renormalize"], memo=memo),)


@dataclass(frozen=True)
class RegionProbe:
    """How the probe runs one region (or an entry beside them): ``reference(point, inputs)``, the
    reference's outputs at a lattice point in the engine's output layout; ``call(fn, inputs)``, the
    engine's implementation called on the inputs (on the probe device; tensors it writes in place
    are cloned). The inputs come from :data:`engineprofiles.probe.inputs.MAKERS`."""

    reference: Callable[[Point, dict[str, Any]], tuple[torch.Tensor, ...]]
    call: Callable[[Callable[..., Any], dict[str, Any]], Any]


# One entry per region and per entry probed beside them; a region without one is refused by name.
PROBES: dict[str, RegionProbe] = {
    "rope": RegionProbe(_rope_reference, lambda fn, d: fn(d["positions"], d["q"].clone(), d["k"].clone(),
                                                          base=d["base"], style=d["style"])),
    "swiglu": RegionProbe(lambda p, d: (swiglu_ref(d["gate"], d["up"], p),), lambda fn, d: fn(d["gate"], d["up"])),
    "add_rmsnorm": RegionProbe(
        lambda p, d: add_rmsnorm_ref(d["x"], d["residual"], d["weight"], d["eps"], p),
        lambda fn, d: fn(d["x"].clone(), d["residual"].clone(), d["weight"], d["eps"])),
    "rmsnorm": RegionProbe(lambda p, d: (rmsnorm_ref(d["x"], d["weight"], d["eps"], p),),
                           lambda fn, d: fn(d["x"].clone(), d["weight"], d["eps"])),
    "moe": RegionProbe(_moe_reference, lambda fn, d: fn(d["x"].clone(), d["w13"], d["w2"], d["router_logits"].clone(),
                                                        d["topk"], renormalize=d["renormalize"])),
    "shared_expert": RegionProbe(
        lambda p, d: (shared_expert_ref(d["x"], d["w_gate_up"], d["w_down"], d["w_gate"], d["routed"], d["residual"],
                                        p),),
        lambda fn, d: fn(d["x"].clone(), d["w_gate_up"], d["w_down"], d["w_gate"], d["routed"].clone(),
                         d["residual"].clone())),
}


def probe_of(region: str) -> RegionProbe:
    """The :class:`RegionProbe` of ``region``; an error naming the probed ones for any other name."""
    try:
        return PROBES[region]
    except KeyError:
        raise EngineProfilesError(f"no probe for region {region!r}; probed: {', '.join(PROBES)}") from None


def reference_outputs(region: str, p: Point, inp: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """The reference's outputs at ``p`` for one probe case, in the engine's output layout."""
    return probe_of(region).reference(p, inp)


def call_engine(region: str, impl: RegionImpl, inp: dict[str, Any], device: str) -> tuple[torch.Tensor, ...]:
    """The engine's implementation of ``region`` on one probe case (moved to ``device``), on the CPU."""
    dev = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    out = probe_of(region).call(impl.fn, dev)
    outs = out if isinstance(out, tuple) else (out,)
    return tuple(o.detach().to("cpu") for o in outs)


def _bits(t: torch.Tensor) -> torch.Tensor:
    width = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype]
    return t.contiguous().view(width).to(torch.int64)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: same value and same bits (NaN equals NaN); different dtypes compare as FP32."""
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: engine gave {tuple(a.shape)}, reference {tuple(b.shape)}")
    if a.dtype != b.dtype:
        a, b = a.float(), b.float()
    return (_bits(a) == _bits(b)) | (torch.isnan(a) & torch.isnan(b))


@dataclass
class CaseResult:
    case: Case
    elements: int
    matches: dict[Point, int]
    identical_to: dict[Point, bool]  # reference at this point equals the engine output, bitwise
    outputs: dict[Point, tuple[torch.Tensor, ...]]
    engine: tuple[torch.Tensor, ...]
    nondeterministic: bool


@dataclass
class RegionResult:
    region: str
    impl: RegionImpl | None
    cases: list[CaseResult] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    unavailable: str | None = None
    seconds: float = 0.0


def probe_region(
    region: str, impl: RegionImpl, dtype: torch.dtype, device: str, seed: int, quick: bool = False,
    progress: Progress | None = None, sweep: list[dict[str, Any]] | None = None,
) -> RegionResult:
    spec = spec_of(region)
    points = spec.all_points()
    res = RegionResult(region, impl)
    t0 = time.perf_counter()
    for case in cases(region, quick, sweep):
        inp = make_inputs(case, dtype, seed)
        try:
            first = call_engine(region, impl, inp, device)
            second = call_engine(region, impl, inp, device)
        except Unavailable as e:
            res.skipped.append(f"{case.label}: {e}")
            continue
        nondet = any(not bool(bitwise_equal(a, b).all()) for a, b in zip(first, second))
        elements = sum(o.numel() for o in first)
        matches, identical, outputs = {}, {}, {}
        for p in points:
            ref = cached_reference_outputs(region, p, inp, (case.region, case.label, dtype, seed))
            if len(ref) != len(first):
                raise ValueError(f"{region}: engine returned {len(first)} tensors, the region has {len(ref)}")
            eq = [bitwise_equal(e, r) for e, r in zip(first, ref)]
            m = sum(int(x.sum()) for x in eq)
            matches[p], identical[p], outputs[p] = m, m == elements, ref
        res.cases.append(CaseResult(case, elements, matches, identical, outputs, first, nondet))
        if progress:
            best = max(matches.values()) / max(elements, 1)
            progress(f"{region} {case.label}: best match {100 * best:.2f}%")
    if not res.cases:
        res.unavailable = "no probe shape ran: " + "; ".join(res.skipped)
    res.seconds = time.perf_counter() - t0
    return res


def _same_outputs(r: RegionResult, p: Point, q: Point) -> bool:
    for c in r.cases:
        for a, b in zip(c.outputs[p], c.outputs[q]):
            if not bool(bitwise_equal(a, b).all()):
                return False
    return True


@dataclass
class Decision:
    winner: Point | None
    evidence: Evidence


def decide(r: RegionResult) -> Decision:
    """Pick the winner and write the evidence, flagging anything that is not clear-cut."""
    spec = spec_of(r.region)
    path = r.impl.path if r.impl else None
    if r.unavailable is not None:
        return Decision(None, Evidence(status="unavailable", reason=r.unavailable, path=path))
    points = list(r.cases[0].matches)
    total = sum(c.elements for c in r.cases)
    score = {p: sum(c.matches[p] for c in r.cases) for p in points}
    best = max(score.values())
    top = [p for p in points if score[p] == best]  # in canonical order: the first is the winner
    winner = top[0]
    same = [q for q in top[1:] if _same_outputs(r, winner, q)]
    tied = [q for q in top[1:] if q not in same]
    # Points with the same output everywhere but different sites: the inputs did not discriminate.
    site_twins = [q for q in same if spec.site_part(q) != spec.site_part(winner)]
    variant_twins = [q for q in same if spec.site_part(q) == spec.site_part(winner)]
    rest = [p for p in points if p not in top]
    runner = max(rest, key=lambda p: score[p]) if rest else None
    # Residual mismatch of the winner.
    max_ulp = 0
    for c in r.cases:
        for e, ref in zip(c.engine, c.outputs[winner]):
            if e.dtype == ref.dtype:
                d = ulp_distance(e, ref)
            else:
                d = ulp_distance(e.float(), ref.float())
            max_ulp = max(max_ulp, int(d.max()) if d.numel() else 0)
    per_shape = []
    shape_dependent = False
    for c in r.cases:
        cbest = max(c.matches.values())
        cwin = next(p for p in points if c.matches[p] == cbest)
        per_shape.append(dict(shape=c.case.label, winner=cwin.label(), match_rate=c.matches[cwin] / max(c.elements, 1)))
        if c.matches[winner] < cbest and spec.site_part(cwin) != spec.site_part(winner):
            shape_dependent = True
    notes = list(r.impl.notes) if r.impl else []
    notes += [f"shape skipped: {s}" for s in r.skipped]
    if site_twins:
        notes.append("points with other rounding sites computed the same bits on every probe input")
    ev = Evidence(
        path=path,
        match_rate=best / total,
        runner_up=runner.label() if runner else None,
        runner_up_match_rate=score[runner] / total if runner else None,
        max_ulp=max_ulp,
        elements=total,
        shapes=[c.case.label for c in r.cases],
        # Ambiguous means the rounding sites are not determined: a tie between points whose sites
        # differ. A tie between formula variants of the winner's sites is listed, not flagged.
        ambiguous=bool(site_twins or any(spec.site_part(q) != spec.site_part(winner) for q in tied)),
        tied_with=[q.label() for q in tied + site_twins],
        indistinguishable=[" ".join(f"{k}={v}" for k, v in spec.variant_part(q).items()) for q in variant_twins],
        shape_dependent=shape_dependent,
        nondeterministic=any(c.nondeterministic for c in r.cases),
        per_shape=per_shape,
        notes=notes,
    )
    return Decision(winner, ev)


def run_probe(
    adapter: Adapter,
    *,
    dtype: str = "bfloat16",
    device: str = "cpu",
    seed: int = 0,
    quick: bool = False,
    regions: list[str] | None = None,
    command: str | None = None,
    progress: Progress | None = None,
    method: str = "op-level",
) -> tuple[Profile, dict[str, RegionResult]]:
    """Probe every region of ``adapter`` and return the profile and the raw results."""
    t0 = time.perf_counter()
    dt = act_dtype(dtype)
    info = adapter.info()
    impls = adapter.regions()
    results: dict[str, RegionResult] = {}
    points: dict[str, Point | None] = {}
    evidence: dict[str, Evidence] = {}
    # The MoE experts and shared expert are probed the same way, recorded beside the regions.
    for name in (*REGIONS, "moe", "shared_expert"):
        if regions is not None and name not in regions:
            impl = Unavailable("not probed in this run (--region)")
        elif name in BESIDE:
            impl = getattr(adapter, name)()
        else:
            impl = impls.get(name)
        if impl is None:
            impl = Unavailable(f"{info.name} has no implementation of {name}")
        if isinstance(impl, Unavailable):
            results[name] = RegionResult(name, None, unavailable=str(impl))
            if progress:
                progress(f"{name}: unavailable ({impl})")
        else:
            if progress:
                progress(f"{name}: probing {impl.path}")
            results[name] = probe_region(name, impl, dt, device, seed, quick, progress, adapter.sweep(name))
        d = decide(results[name])
        points[name], evidence[name] = d.winner, d.evidence
    att_point, att_ev, att_settings = _attention(adapter, regions, dt, seed, quick, progress)
    beside = {n: (points.pop(n), evidence.pop(n)) for n in ("moe", "shared_expert")}
    profile = make_profile(
        engine=dict(
            name=info.name, version=info.version, backend=info.backend, device=info.device,
            torch_version=info.torch_version, execution_mode=info.execution_mode,
            settings={**info.settings, **att_settings},
        ),
        dtype=dtype_name(dt),
        points=points,
        evidence=evidence,
        attention=att_point,
        attention_evidence=att_ev,
        beside=beside,
        provenance=dict(
            date=_dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
            probe_version=PROBE_VERSION,
            package_version=__version__,
            method=method,
            command=command or os.environ.get("ENGINEPROFILES_COMMAND") or shlex.join(["probe-engine", *sys.argv[1:]]),
            host=f"{platform.system()} {platform.machine()}",
            seed=seed,
            duration_s=round(time.perf_counter() - t0, 2),
        ),
    )
    return profile, results


def _attention(adapter: Adapter, regions: list[str] | None, dt: torch.dtype, seed: int, quick: bool,
               progress: Progress | None) -> tuple[Point | None, Evidence, dict[str, Any]]:
    from .attention import probe_attention

    impl = adapter.attention() if regions is None or "attention" in regions else Unavailable(
        "not probed in this run (--region)")
    if isinstance(impl, Unavailable):
        if progress:
            progress(f"attention: unavailable ({impl})")
        return None, Evidence(status="unavailable", reason=str(impl)), {}
    if progress:
        progress(f"attention: probing {impl.path}")
    fit, nondet = probe_attention(impl.fn, dt, seed, quick, progress, extra=adapter.attention_cases())
    ev = fit.evidence(impl.path, notes=impl.notes)
    ev["nondeterministic"] = nondet
    return fit.point, Evidence(**ev), dict(impl.settings)


def machine_record(device: str) -> dict[str, Any]:
    """The ``engine.settings`` entries that describe the machine a probe on ``device`` runs on: on a
    CPU the kernel-selecting features (:mod:`engineprofiles.machine`), on a GPU nothing yet."""
    if device.startswith("cuda"):
        return {}
    from ..machine import record

    return record()


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
