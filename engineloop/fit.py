"""In-situ comparison: the trainer, teacher-forced with the engine's own attention outputs, judged
layer by layer against the tensors the engine materialized.

For each captured sequence, the trainer model (patched with a candidate profile) runs the whole
sequence; at every layer its attention returns the engine's attention output instead of its own,
so each layer is judged on the regions and matmuls between attentions alone. What is compared:
q and k as they enter attention (after RoPE) at every layer, and the final hidden states.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from engineprofiles.machine import KEYS as MACHINE_KEYS

CAPTURE_IMPL = "engineprofiles_teacher"


@dataclass
class LayerMatch:
    matched: int = 0
    total: int = 0

    @property
    def rate(self) -> float:
        return self.matched / self.total if self.total else float("nan")


@dataclass
class FitResult:
    label: str
    layers: dict[str, LayerMatch] = field(default_factory=dict)  # "L0.q", "L0.k", ..., "hidden"

    @property
    def total(self) -> LayerMatch:
        m = LayerMatch()
        for v in self.layers.values():
            m.matched += v.matched
            m.total += v.total
        return m


def _same(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    a, b = a.reshape(-1), b.reshape(-1).to(a.dtype)
    return int(((a == b) | (torch.isnan(a) & torch.isnan(b))).sum()), a.numel()


def _register(state: dict[str, Any]) -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def teacher(module, query, key, value, attention_mask, **kwargs):
        i = state["layer"]
        state["layer"] += 1
        state["qk"].append((query, key))
        eng = state["engine_out"][i]  # [T, Hq, D]
        b, h, t, d = query.shape
        return eng.reshape(1, t, h, d).to(query.dtype), None

    ALL_ATTENTION_FUNCTIONS.register(CAPTURE_IMPL, teacher)


@contextmanager
def attention_implementation(model, name: str):
    """While inside, every config object the model's modules read (usually one, shared) names HF
    attention implementation ``name``; each gets its own setting back afterwards. Yields the
    model's own setting (what a wrapping implementation should call)."""
    configs = {id(c): c for c in [model.config] + [getattr(m, "config", None) for m in model.modules()]
               if c is not None and hasattr(c, "_attn_implementation")}
    old = {k: c._attn_implementation for k, c in configs.items()}
    own = model.config._attn_implementation
    try:
        for c in configs.values():
            c._attn_implementation = name
        yield own
    finally:
        for k, c in configs.items():
            c._attn_implementation = old[k]


def teacher_forced_logprobs(model, seq: dict[str, Any]) -> torch.Tensor:
    """Log-probs of every next token with the engine's attention outputs forced in."""
    _, _, logits = teacher_forced(model, seq, with_logits=True)
    ids = torch.tensor(seq["prompt"] + seq["completion"])
    return torch.log_softmax(logits[:-1].float(), -1).gather(-1, ids[1:].unsqueeze(-1))[:, 0]


def teacher_forced(model, seq: dict[str, Any], with_logits: bool = False):
    """Trainer q/k per layer (as they enter attention) and final hidden states, teacher-forced."""
    state: dict[str, Any] = {"layer": 0, "qk": [], "engine_out": [lay["out"] for lay in seq["layers"]]}
    _register(state)
    hidden: list[torch.Tensor] = []
    h = model.model.norm.register_forward_hook(lambda m, a, o: hidden.append(o[0] if isinstance(o, tuple) else o))
    try:
        ids = torch.tensor(seq["prompt"] + seq["completion"]).unsqueeze(0)
        with attention_implementation(model, CAPTURE_IMPL), torch.no_grad():
            logits = model(input_ids=ids).logits[0]
    finally:
        h.remove()
    if with_logits:
        return state["qk"], hidden[0][0], logits
    return state["qk"], hidden[0][0]


def compare(model, capture: dict[str, Any], label: str) -> FitResult:
    res = FitResult(label)
    for seq in capture["sequences"]:
        if any(lay is None for lay in seq["layers"]):
            continue
        qk, hid = teacher_forced(model, seq)
        for i, ((q, k), lay) in enumerate(zip(qk, seq["layers"])):
            t = q.shape[2]
            for name, mine, eng in (("q", q[0].transpose(0, 1), lay["q"]), ("k", k[0].transpose(0, 1), lay["k"])):
                m, n = _same(mine.reshape(t, -1), eng.reshape(t, -1))
                lm = res.layers.setdefault(f"L{i}.{name}", LayerMatch())
                lm.matched += m
                lm.total += n
        if seq.get("hidden") is not None:
            m, n = _same(hid, seq["hidden"])
            lm = res.layers.setdefault("hidden", LayerMatch())
            lm.matched += m
            lm.total += n
    return res


def compare_pairs(pairs: list[tuple[str, Any, dict[str, Any]]], label: str) -> FitResult:
    """:func:`compare` over several (family, model, capture) pairs; the tensors of each family are
    named ``family:L0.q`` ... when there is more than one."""
    if len(pairs) == 1:
        _, model, cap = pairs[0]
        return compare(model, cap, label)
    res = FitResult(label)
    for family, model, cap in pairs:
        for k, v in compare(model, cap, label).layers.items():
            res.layers[f"{family}:{k}"] = v
    return res


FIT_ORDER = ("rmsnorm", "rope", "add_rmsnorm", "swiglu")


@dataclass
class Fit:
    points: dict[str, Any]  # region -> Point
    best: FitResult
    candidates: dict[str, list[tuple[Any, FitResult]]]  # region -> [(point, result)] of the last sweep
    start: FitResult


def fit_profile(model, capture: dict[str, Any], start: "Profile", note=lambda m: None,  # noqa: F821
                regions: tuple[str, ...] = FIT_ORDER, passes: int = 2) -> Fit:
    """:func:`fit_profiles` of one model and its capture."""
    return fit_profiles([("", model, capture)], start, note=note, regions=regions, passes=passes)


def fit_profiles(pairs: list[tuple[str, Any, dict[str, Any]]], start: "Profile", note=lambda m: None,  # noqa: F821
                 regions: tuple[str, ...] = FIT_ORDER, passes: int = 2) -> Fit:
    """Coordinate search over the lattice, starting from ``start`` (the op-level profile): for each
    region in turn, every canonical point with the other regions fixed; keep the point whose
    teacher-forced trainer matches the engine's tensors on the most elements, summed over every
    (family, model, capture) pair (ties keep the current point). Two passes, or until nothing
    changes. Fitting several families at once keeps one profile true for all of them (Qwen3's q/k
    norms exercise the plain RMSNorm's output site, which Qwen2 and Llama never hand on in FP32)."""
    from emulator.patching import apply_profile
    from engineprofiles.regions import REGIONS
    from engineprofiles.schema import with_points

    from emulator.functional import use_backend

    # An engine that compiles its regions with Inductor sums the norms' squares in Inductor's order:
    # fit with the trainer's norms compiled the same way (what exact mode runs).
    backend = "reference-inductor" if start.engine.execution_mode == "inductor" else "reference"

    def run(points, label):
        prof = with_points(start, points)  # attention and the MoE experts kept (an MoE model needs them)
        handles = [apply_profile(m, prof) for _, m, _ in pairs]
        try:
            with use_backend(backend):
                return compare_pairs(pairs, label)
        finally:
            for h in handles:
                h.remove()

    current = {n: start.point(n) for n in REGIONS}
    start_res = run(current, "start")
    best = start_res
    candidates: dict[str, list] = {}
    for sweep in range(passes):
        changed = False
        for region in regions:
            results = []
            for p in REGIONS[region].all_points():
                pts = dict(current, **{region: p})
                results.append((p, run(pts, p.label())))
            candidates[region] = results
            top = max(r.total.matched for _, r in results)
            cur = next(r for p, r in results if p == current[region])
            if cur.total.matched < top:
                p, r = next((p, r) for p, r in results if r.total.matched == top)
                note(f"in situ: {region} -> {p.label()} ({r.total.rate:.4%} of all captured elements match with the regions fitted so far)")
                current[region] = p
                best = r
                changed = True
            else:
                best = cur
        if not changed:
            break
    return Fit(current, best, candidates, start_res)


def fit_attention_in_situ(capture: dict[str, Any] | list[dict[str, Any]], start: "Profile",  # noqa: F821
                          note=lambda m: None):
    """The attention lattice fitted to the engine's own attention calls in the capture(s) (prefill and
    decode), starting from the op-level profile's attention where it has one."""
    from engineprofiles.probe.attention import START, fit_attention

    caps = capture if isinstance(capture, list) else [capture]
    samples = [s for c in caps for s in attention_samples(c)]
    if not samples:
        return None
    begin = start.point("attention") if start.available("attention") else START
    note(f"in situ: fitting attention to {len(samples)} captured calls (prefill and decode)")
    return fit_attention(samples, start=begin, note=note)


def _captures(capture: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return capture if isinstance(capture, list) else [capture]


def _families(family: str | list[str]) -> str:
    fams = [family] if isinstance(family, str) else list(family)
    return fams[0] if len(fams) == 1 else ", ".join(fams[:-1]) + " and " + fams[-1]


def attention_evidence(att_fit, capture: dict[str, Any] | list[dict[str, Any]], family: str | list[str]) -> dict[str, Any]:
    caps = _captures(capture)
    eng = caps[0]["engine"]
    b = eng.get("attention", {})
    path = (f"{eng['name']} {eng['version']} {b.get('backend', '?')} ({b.get('impl', '?')}, isa {b.get('isa', '?')}, "
            f"block size {b.get('block_size', '?')}), in the running engine")
    n_seq = sum(len(c["sequences"]) for c in caps)
    n_tok = sum(len(s["prompt"]) + len(s["completion"]) for c in caps for s in c["sequences"])
    notes = [f"in situ on tiny {_families(family)} models: {n_seq} sequences, {n_tok} tokens; every "
             "attention call of the sampling (prompt prefill, one call per decoded token) and of the re-scoring "
             "prefill, compared bitwise with the reference at each point",
             f"engine threads {b.get('torch_threads', '?')}, split-KV {b.get('split_kv', '?')}: the kernel's "
             "reduction order can depend on both for long sequences (not in the lattice)"]
    return att_fit.evidence(path, notes=notes)


def in_situ_profile(fit: Fit, start: "Profile", capture: dict[str, Any] | list[dict[str, Any]],  # noqa: F821
                    family: str | list[str], command: str, attention_fit: Any = None) -> "Profile":  # noqa: F821
    """The in-situ profile of ``fit`` (started from the op-level ``start``) on ``capture`` (one per family):
    the regions' evidence, the engine and machine the capture ran on, attention's fitted point, and the
    MoE entries carried over from the start."""
    import datetime as _dt

    from engineprofiles import PROBE_VERSION, __version__
    from engineprofiles.schema import make_profile

    caps = _captures(capture)
    fams = [family] if isinstance(family, str) else list(family)
    eng = caps[0]["engine"]
    if attention_fit is not None:
        att_point, att_ev = attention_fit.point, attention_evidence(attention_fit, capture, family)
    else:
        att_point, att_ev = None, {"status": "unavailable",
                                   "reason": "the capture holds no attention calls of the engine"}
    return make_profile(
        engine=_in_situ_engine(start, caps, fams),
        dtype=start.dtype,
        points=fit.points,
        evidence=_in_situ_evidence(fit, start, caps, fams),
        attention=att_point,
        attention_evidence=att_ev,
        beside=_carried_over(start, eng),
        provenance=dict(
            date=_dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
            probe_version=PROBE_VERSION, package_version=__version__, method="in-situ", command=command,
            seed=caps[0].get("seed"),
        ),
    )


def _in_situ_evidence(fit: Fit, start: "Profile", caps: list[dict[str, Any]],  # noqa: F821
                      fams: list[str]) -> dict[str, dict[str, Any]]:
    """Each region's evidence of the in-situ fit: the whole model's match rate, the runner-up, ties."""
    from engineprofiles.regions import REGIONS

    n_seq = sum(len(c["sequences"]) for c in caps)
    n_tok = sum(len(s["prompt"]) + len(s["completion"]) for c in caps for s in c["sequences"])
    first = caps[0]["engine"]
    scalings = sorted({c.get("rope_scaling") for c in caps if c.get("rope_scaling")})
    scaled = f" with {' and '.join(scalings)} RoPE scaling" if scalings else ""
    evidence = {}
    for region in REGIONS:
        spec = REGIONS[region]
        win = fit.points[region]
        results = fit.candidates.get(region, [])
        total = fit.best.total
        others = sorted(((r.total.matched, p) for p, r in results if spec.site_part(p) != spec.site_part(win)),
                        key=lambda x: -x[0])
        tied = [p.label() for m, p in others if m == total.matched]
        op = start.point(region)
        notes = [f"in situ on tiny {_families(fams)} models{scaled}: {n_seq} sequences, {n_tok} tokens, teacher-forced with "
                 f"the engine's attention outputs; compared: q and k entering attention at every layer"
                 + (" and the final hidden states" if any(k.endswith("hidden") for k in fit.best.layers) else ""),
                 "match_rate and elements are of the whole model (every captured tensor) under the fitted profile: "
                 "the regions are fitted jointly; per_shape gives each tensor's rate"]
        if first.get("compilation_mode") not in (None, "NONE") and start.engine.execution_mode == "inductor":
            notes.append("the trainer's norms ran compiled by Inductor (emulator backend reference-inductor), as "
                         "exact mode runs them for this engine")
        if spec.site_part(op) != spec.site_part(win):
            notes.append(f"op-level probe said {op.label()}; in situ wins")
        evidence[region] = dict(
            scope="whole-model",
            path=f"{first['name']} {first['version']} whole model ({first.get('compilation_mode', '')}), captured in situ",
            match_rate=total.rate,
            runner_up=others[0][1].label() if others else None,
            runner_up_match_rate=(others[0][0] / total.total) if others else None,
            elements=total.total,
            shapes=[k if len(fams) > 1 else f"{fams[0]}: {k}" for k in fit.best.layers],
            ambiguous=bool(tied),
            tied_with=tied,
            per_shape=[dict(shape=k, winner=win.label(), match_rate=v.rate) for k, v in fit.best.layers.items()],
            notes=notes,
        )
    return evidence


def _in_situ_engine(start: "Profile", caps: list[dict[str, Any]], fams: list[str]):  # noqa: F821
    """The profile's engine description: the op-level start's, except what the capture itself measured on."""
    first = caps[0]["engine"]
    scalings = sorted({c.get("rope_scaling") for c in caps if c.get("rope_scaling")})
    # The engine description is the op-level start's, except what the capture itself measured on:
    # the evidence belongs to the machine and torch the engine ran on, not the start's.
    settings = dict(start.engine.settings)
    settings["in_situ_family"] = fams[0] if len(fams) == 1 else fams
    if scalings:
        settings["in_situ_rope_scaling"] = scalings[0] if len(scalings) == 1 else scalings
    eng = first
    # What the capture's engine ran with, where it says (SGLang: the attention backend in effect, the
    # radix cache, the sgl_kernel stand-in).
    for k, v in sorted((eng.get("settings") or {}).items()):
        settings[f"in_situ.{k}"] = v
    # The machine is the capture's, never the start's (which may have been probed elsewhere): a capture
    # that does not record it (made before captures did) leaves the profile's machine unrecorded.
    for k in (*MACHINE_KEYS, "cpu_emulated", "kernel_libraries", "attention_isa"):
        settings.pop(k, None)
    settings.update({k: v for k, v in (eng.get("machine") or {}).items() if k in MACHINE_KEYS and v is not None})
    if eng.get("cpu_capability") is not None:
        settings["cpu_capability"] = eng["cpu_capability"]
    if eng.get("cpu_emulated"):
        settings["cpu_emulated"] = eng["cpu_emulated"]
    if eng.get("kernel_libraries"):
        settings["kernel_libraries"] = list(eng["kernel_libraries"])
    isa = (eng.get("attention") or {}).get("isa")
    if isa is not None:
        settings["attention_isa"] = str(isa)
    update: dict[str, Any] = {"settings": settings, "device": str(eng.get("device") or "unrecorded (the capture "
                                                                  "predates device records)")}
    if eng.get("torch_version"):
        update["torch_version"] = eng["torch_version"]
    return start.engine.model_copy(update=update)


def _carried_over(start: "Profile", eng: dict[str, Any]) -> dict[str, tuple[Any, Any]]:  # noqa: F821
    # The MoE experts and shared expert are not fitted in situ (the fitted tiny models are dense): the
    # op-level entries the fit started from are carried over, saying so. vLLM runs them inside the
    # MoE block's opaque op, outside what its compiled graph fuses; the shared expert's entry also
    # holds the block's sum, which the op-level probe measured compiled into the next residual add.
    beside: dict[str, tuple[Any, Any]] = {}
    start_cap, cap = start.engine.settings.get("cpu_capability"), eng.get("cpu_capability")
    for name, what in (("moe", "the MoE experts"), ("shared_expert", "the MoE shared expert")):
        ev = start.entry(name).evidence.model_dump()
        point = start.point(name) if start.available(name) else None
        if point is not None and cap is not None and start_cap != cap:
            # The fused kernels dispatch by ISA: a result measured on another capability is not known here.
            point, ev = None, {"status": "unavailable", "reason": (
                f"not probed on {cap}: the op-level profile {start.canonical_name} measured {what} on "
                f"{start_cap}; probe them op-level on {cap}")}
        elif point is not None:
            ev["notes"] = [*ev.get("notes", []), f"op-level, carried over from {start.canonical_name} (the "
                           "in-situ fit runs dense models; this entry is not fitted in situ)"]
        beside[name] = (point, ev)
    return beside


def attention_samples(capture: dict[str, Any]) -> list["AttentionSample"]:  # noqa: F821
    """What the engine's attention took and returned, as probe samples: per sequence and layer, the
    re-scoring prefill of the whole sequence, the sampling's prompt prefill, and the sampling's
    decode calls stacked (each decode query sees the keys cached up to its own position), or one
    sample per decode call where the capture says ``attention.decode_samples: per_call``."""
    from engineprofiles.probe.attention import AttentionSample

    scale = float(capture["engine"].get("attention", {}).get("scale") or 0.0)
    # "per_call": the capture asks for each decode call as its own sample (SGLang); else they are stacked.
    per_call = capture["engine"].get("attention", {}).get("decode_samples") == "per_call"
    out: list[AttentionSample] = []
    for seq in capture["sequences"]:
        for i, lay in enumerate(seq["layers"]):
            if lay is None:
                continue
            sc = scale or lay["q"].shape[-1] ** -0.5
            out.append(AttentionSample(lay["q"], lay["k"], lay["v"], lay["out"], sc, "prefill"))
            calls = (seq.get("sample_calls") or [[]] * len(seq["layers"]))[i]
            if not calls:
                continue
            first = calls[0]
            out.append(AttentionSample(first["q"], first["k"], first["v"], first["out"], sc, "prefill"))
            dec = calls[1:]
            if not dec or any(c["q"].shape[0] != 1 for c in dec):
                continue
            if per_call:
                # One sample per decode call, with exactly the keys that call saw: kernels whose reduction
                # order depends on the row's length (torch's CPU flash attention) see each call as it was.
                for n, c in enumerate(dec, start=2):
                    k = torch.cat([x["k"] for x in calls[:n]])
                    v = torch.cat([x["v"] for x in calls[:n]])
                    out.append(AttentionSample(c["q"], k, v, c["out"].reshape(c["q"].shape), sc, "decode"))
                continue
            k = torch.cat([c["k"] for c in calls])
            v = torch.cat([c["v"] for c in calls])
            q = torch.cat([c["q"] for c in dec])
            o = torch.cat([c["out"].reshape(1, *c["q"].shape[1:]) for c in dec])
            pos = torch.arange(first["q"].shape[0], first["q"].shape[0] + len(dec))
            mask = torch.arange(k.shape[0])[None, :] <= pos[:, None]
            out.append(AttentionSample(q, k, v, o, sc, "decode", mask=mask))
    return out


def in_situ_pairs(engine: str, families: list[str], captures: list[str], *, seed: int, prompts: int, mode: str,
                  env: str | None, rope_scaling: str | None, note) -> list[tuple[str, Any, dict[str, Any]]]:
    """(family, tiny model, capture) for each family: the capture file given for it (``captures``, one per
    family in order, checked against the family and RoPE scaling), else the engine run on the tiny model
    now. Captures of another engine, version or mode than the first are refused."""
    import tempfile
    from pathlib import Path

    from engineprofiles.errors import EngineProfilesError
    from engineprofiles.models import tiny_model

    from .mismatch import load_capture, run_capture, save_model

    if captures and len(captures) != len(families):
        raise EngineProfilesError(f"{len(captures)} --capture file(s) for {len(families)} --family: give one "
                                  "capture per family, in the same order")
    caps = [load_capture(c) for c in captures]
    pairs = []
    for i, family in enumerate(families):
        cap = caps[i] if caps else None
        if cap is not None and cap.get("checkpoint"):
            raise EngineProfilesError(f"{captures[i]} was captured on the checkpoint {cap['checkpoint'].get('path')} "
                                      "(mismatch/localize --model); the in-situ fit runs on the tool's tiny models")
        if cap is not None and cap.get("family", family) != family:
            raise EngineProfilesError(f"{captures[i]} was captured on a {cap['family']} model, not {family}")
        if cap is not None and cap.get("rope_scaling") != rope_scaling:
            got, want = (f"RoPE scaling {x}" if x else "default RoPE" for x in (cap.get("rope_scaling"), rope_scaling))
            raise EngineProfilesError(f"{captures[i]} was captured on a model with {got}, not {want}")
        model = tiny_model(family, seed=seed, rope_scaling=rope_scaling, **((cap or {}).get("model_size") or {})).eval()
        if cap is None:
            with tempfile.TemporaryDirectory() as tmp:
                save_model(model, Path(tmp) / "model")
                cap = run_capture(engine, Path(tmp) / "model", Path(tmp) / "cap.pt", prompts=prompts, max_tokens=16,
                                  seed=seed, env=env, note=note, mode="eager" if mode == "eager" else "default")
            cap["family"], cap["rope_scaling"] = family, rope_scaling
        pairs.append((family, model, cap))
    first = pairs[0][2]["engine"]
    version, cap_mode = first["version"], first.get("mode", "default")
    for family, _, c in pairs[1:]:
        if (c["engine"]["version"], c["engine"].get("mode", "default")) != (version, cap_mode):
            raise EngineProfilesError(f"the {family} capture comes from {c['engine']['name']} {c['engine']['version']} "
                                      f"({c['engine'].get('mode')}), the first from {version} ({cap_mode})")
    for family, _, c in pairs:
        if c["engine"]["name"] != engine:
            raise EngineProfilesError(f"the {family} capture comes from {c['engine']['name']}, not {engine}")
    return pairs


def in_situ_start(engine: str, capture: dict[str, Any]) -> "Profile":  # noqa: F821
    """The shipped op-level profile an in-situ fit starts from: the capture's engine version and mode."""
    from engineprofiles import store
    from engineprofiles.errors import EngineProfilesError
    from engineprofiles.names import op_level_name

    version, mode = capture["engine"]["version"], capture["engine"].get("mode", "default")
    name = op_level_name(engine, version, "eager" if mode == "eager" else "default")
    try:
        return store.get_profile(name)
    except EngineProfilesError:
        raise EngineProfilesError(f"the in-situ fit starts from the op-level profile {name}; make it first with "
                                  f"`scripts/probe.sh {engine} {version} --op-level --ship`") from None
