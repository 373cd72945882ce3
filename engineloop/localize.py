"""Divergence localizer: the first tensor of the trainer's forward whose bits differ from what the
engine materialized on the same tiny model, the match rate at every tensor, and which change of
the profile (a neighbour in a region's lattice, exact mode) would remove that divergence.

The trainer runs free (no teacher forcing): a difference anywhere propagates, so the first tensor
that differs is where the stacks part. Tensors, in the order a decoder layer computes them:

    L<i>.residual   the residual stream entering layer i (the embedding for layer 0)
    L<i>.in_norm    the input RMSNorm's output (what the q/k/v projections read)
    L<i>.q, .k, .v  what enters attention (q and k after RoPE)
    L<i>.attn_out   attention's output (before the output projection)
    L<i>.post_norm  the post-attention residual RMSNorm's output (what the MLP reads)
    L<i>.mlp_out    the MLP's output (after SwiGLU and the down projection)
    final_norm      the final RMSNorm's output (what the LM head reads)
    logprobs        the log-prob of every next token of the re-scored sequence

A compiled engine runs its layers as one graph, so only what crosses attention's boundary (q, k,
v, attn_out), the final hidden states and the log-probs are observable there; the engine's eager
mode (``--mode eager``) shows every tensor. The trainer's tensors are read with module hooks and a
wrapper around the attention function, so the trainer under test runs its own code unchanged.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from engineprofiles.errors import EngineProfilesError
from engineprofiles.regions import ATTENTION_SPEC, REGIONS, Point
from engineprofiles.schema import Profile, with_points

from .fit import attention_implementation

LAYER_TENSORS = ("residual", "in_norm", "q", "k", "v", "attn_out", "post_norm", "mlp_out")
MODULE_TENSORS = ("residual", "in_norm", "post_norm", "mlp_out")  # observable in an eager engine only

# What computes each tensor from the one before it: where to look when it is the first to differ.
PRODUCERS = {
    "residual": "the residual add (add_rmsnorm's residual_out site), or the MLP output added",
    "in_norm": "the input RMSNorm (rmsnorm on layer 0, add_rmsnorm after)",
    "q": "RoPE on q (or a q/k norm), or the q projection",
    "k": "RoPE on k (or a q/k norm), or the k projection",
    "v": "the v projection (no region of its own: a matmul)",
    "attn_out": "attention (the profile's attention entry; exact mode)",
    "post_norm": "the post-attention residual RMSNorm (add_rmsnorm), or the output projection before it",
    "mlp_out": "SwiGLU (silu(gate) * up), or the gate/up/down projections",
    "final_norm": "the final residual RMSNorm (add_rmsnorm)",
    "logprobs": "the LM head and log-softmax (outside the profile's regions)",
}

TRACE_IMPL = "engineloop_localize"
TRAINERS = ("as-is", "profile", "exact")


def tensor_names(n_layers: int) -> list[str]:
    return [f"L{i}.{t}" for i in range(n_layers) for t in LAYER_TENSORS] + ["final_norm", "logprobs"]


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.reshape(n, -1)


def _decoder_layers(model) -> list[torch.nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise EngineProfilesError(f"{type(model).__name__} has no model.layers: the localizer reads HF decoder models")
    return list(layers)


@contextmanager
def tracing(model, modules: bool = True) -> Iterator[dict[str, torch.Tensor]]:
    """While inside, every forward of ``model`` (batch of one) records its tensors by name, as
    [tokens, ...] tensors in the dtype the trainer computed them in. ``modules=False``: only what
    crosses attention's boundary and the final norm (what a compiled engine shows). A trainer whose
    stack runs compiled (exact mode for an Inductor engine) must be observed so: each tensor a hook
    keeps becomes an output of its graph, which Inductor then realizes, changing its fusion and the
    bits being measured."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import emulator.functional as F

    rec: dict[str, torch.Tensor] = {}
    state = {"layer": -1}
    hooks = []

    def keep(name: str, t: torch.Tensor) -> None:
        rec[name] = t.detach()[0].clone() if t.dim() >= 3 else t.detach().clone()

    for i, layer in enumerate(_decoder_layers(model) if modules else []):
        def pre_layer(mod, args, kwargs, _i=i):
            state["layer"] = _i
            keep(f"L{_i}.residual", args[0] if args else kwargs["hidden_states"])

        def pre_attn(mod, args, kwargs, _i=i):
            keep(f"L{_i}.in_norm", args[0] if args else kwargs["hidden_states"])

        hooks += [layer.register_forward_pre_hook(pre_layer, with_kwargs=True),
                  layer.self_attn.register_forward_pre_hook(pre_attn, with_kwargs=True),
                  layer.mlp.register_forward_pre_hook(lambda mod, args, _i=i: keep(f"L{_i}.post_norm", args[0])),
                  layer.mlp.register_forward_hook(lambda mod, args, out, _i=i: keep(f"L{_i}.mlp_out", out))]
    hooks.append(model.model.norm.register_forward_hook(
        lambda mod, args, out: keep("final_norm", out[0] if isinstance(out, tuple) else out)))

    def record_qkv(q, k, v):  # [B, H, T, D] -> [T, H, D]
        if not modules:  # no layer hook counts the layers: the attention calls do, in order
            state["layer"] += 1
        i = state["layer"]
        for name, t in (("q", q), ("k", k), ("v", v)):
            rec[f"L{i}.{name}"] = t.detach()[0].transpose(0, 1).clone()

    def traced(module, query, key, value, attention_mask, **kwargs):
        record_qkv(query, key, value)
        orig = state["impl"]
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        out, w = ALL_ATTENTION_FUNCTIONS.get_interface(orig, eager)(module, query, key, value, attention_mask, **kwargs)
        rec[f"L{state['layer']}.attn_out"] = out.detach()[0].clone()  # [T, H, D]
        return out, w

    orig_attention = F.attention

    def traced_exact(q, k, v, point, **kwargs):
        record_qkv(q, k, v)
        out = orig_attention(q, k, v, point, **kwargs)  # [B, H, T, D]
        rec[f"L{state['layer']}.attn_out"] = out.detach()[0].transpose(0, 1).clone()
        return out

    ALL_ATTENTION_FUNCTIONS.register(TRACE_IMPL, traced)
    try:
        with attention_implementation(model, TRACE_IMPL) as own:
            state["impl"] = own
            F.attention = traced_exact
            yield rec
    finally:
        F.attention = orig_attention
        for h in hooks:
            h.remove()


def trainer_tensors(model, seq: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The trainer's tensors of one captured sequence (prompt + completion, one forward)."""
    from .mismatch import sequence_logprobs

    with tracing(model, modules=seq.get("modules") is not None) as rec:
        _, logprobs = sequence_logprobs(model, seq)
    return dict(rec, logprobs=logprobs)


def engine_tensors(seq: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The engine's tensors of one captured sequence, under the same names (what it observed)."""
    out: dict[str, torch.Tensor] = {}
    mods = seq.get("modules") or [None] * len(seq["layers"])
    for i, (lay, mod) in enumerate(zip(seq["layers"], mods)):
        for name in LAYER_TENSORS:
            if name in MODULE_TENSORS:
                t = (mod or {}).get(name)
            else:
                t = (lay or {}).get("out" if name == "attn_out" else name)
            if t is not None:
                out[f"L{i}.{name}"] = t
    if seq.get("hidden") is not None:
        out["final_norm"] = seq["hidden"]
    lp = seq["prompt_logprobs"][1:]
    if lp and all(x is not None for x in lp):
        out["logprobs"] = torch.tensor(lp, dtype=torch.float32)
    return out


@dataclass
class TensorMatch:
    name: str
    matched: int = 0
    total: int = 0
    shape_differs: bool = False  # some sequence's tensors had different sizes: counted as all differing

    @property
    def rate(self) -> float:
        return self.matched / self.total if self.total else float("nan")

    @property
    def exact(self) -> bool:
        return self.total > 0 and self.matched == self.total


def _same_values(mine: torch.Tensor, eng: torch.Tensor, n: int) -> tuple[int, int, bool]:
    """Elements whose values are equal (NaN equals NaN), both compared in FP32: a BF16 value and an
    FP32 value are equal only when the FP32 one is representable in BF16 and is that value."""
    a, b = _rows(mine, n).float(), _rows(eng, n).float()
    if a.shape != b.shape:
        return 0, max(a.numel(), b.numel()), True
    return int(((a == b) | (torch.isnan(a) & torch.isnan(b))).sum()), a.numel(), False


def compare_tensors(model, capture: dict[str, Any]) -> list[TensorMatch]:
    """Per observed tensor, in forward order, the elements of the trainer's equal to the engine's,
    summed over the captured sequences (those whose re-scoring prefill was captured)."""
    seqs = [s for s in capture["sequences"] if all(lay is not None for lay in s["layers"])]
    if not seqs:
        raise EngineProfilesError("the capture holds no re-scoring prefill of a whole sequence at every layer: nothing to "
                                  "localize; capture again (probe-engine localize without --capture)")
    names = tensor_names(len(seqs[0]["layers"]))
    res = {n: TensorMatch(n) for n in names}
    seen: set[str] = set()
    for seq in seqs:
        eng = engine_tensors(seq)
        mine = trainer_tensors(model, seq)
        n_tok = len(seq["prompt"]) + len(seq["completion"])
        for name, e in eng.items():
            if name not in mine:
                continue
            m, t, bad = _same_values(mine[name], e, n_tok - 1 if name == "logprobs" else n_tok)
            r = res[name]
            r.matched += m
            r.total += t
            r.shape_differs |= bad
            seen.add(name)
    return [res[n] for n in names if n in seen]


def first_divergence(rows: list[TensorMatch]) -> int:
    """Index of the first tensor that is not bit-equal; len(rows) when all are."""
    return next((i for i, r in enumerate(rows) if not r.exact), len(rows))


@dataclass
class Fix:
    change: str
    first_after: str | None  # the first differing tensor with the change (None: every observed tensor matches)
    rate_at_first: float  # the match rate, with the change, of the tensor that differed first without it
    removes: bool  # with the change, that tensor matches bit for bit
    moves_later: int  # how many tensors further the first divergence moved (negative: earlier)

    def as_dict(self) -> dict[str, Any]:
        return dict(change=self.change, removes=self.removes, first_divergence_after=self.first_after,
                    match_rate_at_first=self.rate_at_first, moves_later=self.moves_later)


@dataclass
class Localization:
    trainer: str
    rows: list[TensorMatch]
    fixes: list[Fix] = field(default_factory=list)
    candidates_tried: int = 0

    @property
    def first(self) -> TensorMatch | None:
        i = first_divergence(self.rows)
        return self.rows[i] if i < len(self.rows) else None

    def as_dict(self) -> dict[str, Any]:
        f = self.first
        kind = f.name.split(".")[-1] if f else None
        return dict(
            trainer=self.trainer,
            first_divergence=None if f is None else dict(
                tensor=f.name, layer=int(f.name[1:].split(".")[0]) if f.name.startswith("L") else None,
                match_rate=f.rate, produced_by=PRODUCERS[kind]),
            tensors=[dict(name=r.name, matched=r.matched, total=r.total, match_rate=r.rate,
                          **({"shape_differs": True} if r.shape_differs else {})) for r in self.rows],
            candidates_tried=self.candidates_tried,
            fixes=[x.as_dict() for x in self.fixes],
        )


def neighbours(spec, point: Point) -> list[Point]:
    """The lattice points one choice away from ``point`` (each site or variant set to each of its
    other options, canonicalized), in a stable order."""
    out: list[Point] = []
    for c in spec.choices:
        for opt in c.options:
            if opt == point[c.name]:
                continue
            p = spec.canonicalize(Point(spec.name, {**dict(point), c.name: opt}))
            if p != point and p not in out:
                out.append(p)
    return out


def with_point(prof: Profile, region: str, point: Point) -> Profile:
    """``prof`` with one region's (or attention's) point replaced; the rest, attention included, kept."""
    return with_points(prof, {region: point})


def candidates(trainer: str, prof: Profile, trainer_prof: Profile) -> list[tuple[str, Profile, bool]]:
    """(label, profile, exact) of every change tried for a trainer: for the trainer as-is, the engine's
    profile (whole, in exact mode, and each region of it alone); for a patched trainer, every
    lattice neighbour of each region (and of attention in exact mode), and exact mode itself."""
    from .mismatch import ABLATIONS, combine

    if trainer == "as-is":
        out = [("apply the engine's profile", prof, False)]
        if prof.available("attention"):
            out.append(("apply the engine's profile, exact=True", prof, True))
        out += [(f"adopt the engine's {label} only", combine(trainer_prof, prof, regs), False)
                for label, regs in ABLATIONS.items()]
        return out
    ex = trainer == "exact"
    out = [] if ex or not prof.available("attention") else [("exact=True (the profile's attention)", prof, True)]
    for region, spec in REGIONS.items():
        if not prof.available(region):
            continue
        cur = prof.point(region)
        for p in neighbours(spec, cur):
            changed = ", ".join(f"{k}={p[k]}" for k in p if p[k] != cur[k])
            out.append((f"{region}: {changed}", with_point(prof, region, p), ex))
    if ex:
        cur = prof.point("attention")
        for p in neighbours(ATTENTION_SPEC, cur):
            changed = ", ".join(f"{k}={p[k]}" for k in p if p[k] != cur[k])
            out.append((f"attention: {changed}", with_point(prof, "attention", p), True))
    return out


def _run(model, capture, prof: Profile | None, exact: bool) -> list[TensorMatch]:
    import warnings

    from emulator.errors import MachineMismatch
    from emulator.patching import apply_profile

    # Localizing measures: exact mode runs its point on any machine; run_localize says in the report
    # when the profile does not describe this machine (then exact mode's bits are not claimed).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MachineMismatch)
        handle = apply_profile(model, prof, exact=exact, allow_other_machine=exact) if prof is not None else None
    try:
        return compare_tensors(model, capture)
    finally:
        if handle is not None:
            handle.remove()


def localize(model, capture: dict[str, Any], trainer: str, prof: Profile, trainer_prof: Profile,
             note: Callable[[str], None] = lambda m: None, try_fixes: bool = True) -> Localization:
    """Localize the first divergence of ``trainer`` (as-is, profile, exact) from the capture, then
    try :func:`candidates` and keep those that change something at or after it."""
    if trainer not in TRAINERS:
        raise EngineProfilesError(f"unknown trainer {trainer!r}; trainers: {', '.join(TRAINERS)}")
    base = None if trainer == "as-is" else prof
    rows = _run(model, capture, base, trainer == "exact")
    loc = Localization(trainer, rows)
    i = first_divergence(rows)
    if i == len(rows) or not try_fixes:
        return loc
    cands = candidates(trainer, prof, trainer_prof)
    note(f"trainer {trainer}: first divergence at {rows[i].name} ({rows[i].rate:.2%}); trying {len(cands)} changes")
    loc.candidates_tried = len(cands)
    for label, p, ex in cands:
        got = _run(model, capture, p, ex)
        if [r.name for r in got] != [r.name for r in rows]:
            continue
        j = first_divergence(got)
        fix = Fix(label, got[j].name if j < len(got) else None, got[i].rate, got[i].exact, j - i)
        if fix.moves_later > 0 or (fix.moves_later == 0 and fix.rate_at_first > rows[i].rate):
            loc.fixes.append(fix)
    loc.fixes.sort(key=lambda f: (-f.moves_later, -f.rate_at_first, f.change))
    return loc


@dataclass
class LocalizeReport:
    engine: dict[str, Any]
    family: str
    profile_name: str
    trainer_profile_name: str
    model: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    results: list[Localization] = field(default_factory=list)
    unobserved: list[str] = field(default_factory=list)
    command: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(engine=self.engine, family=self.family, profile=self.profile_name,
                    trainer_profile=self.trainer_profile_name, model=self.model, warnings=self.warnings,
                    unobserved=self.unobserved, command=self.command, trainers=[r.as_dict() for r in self.results])


def run_localize(engine: str = "vllm", *, family: str = "qwen2", trainers: tuple[str, ...] = ("as-is", "profile"),
                 profile: str | None = None, prompts: int = 2, max_tokens: int = 8, seed: int = 0,
                 env: str | None = None, capture_file: str | None = None, save_capture: str | None = None,
                 mode: str = "default", size: dict[str, int] | None = None, prompt_len: int = 12,
                 note: Callable[[str], None] = lambda m: None, try_fixes: bool = True,
                 rope_scaling: str | None = None, model_path: str | None = None) -> LocalizeReport:
    from .mismatch import engine_profile, model_and_capture, model_fields, trainer_profile_name
    from engineprofiles.store import get_profile

    bad = [t for t in trainers if t not in TRAINERS]
    if bad or not trainers:
        raise EngineProfilesError(f"--trainer must be among {', '.join(TRAINERS)}; got {', '.join(bad) or 'none'}")
    model, cap = model_and_capture(engine, family, size=size, capture_file=capture_file, save_capture=save_capture,
                                   prompts=prompts, max_tokens=max_tokens, seed=seed, env=env, workdir=None,
                                   note=note, mode=mode, prompt_len=prompt_len, rope_scaling=rope_scaling,
                                   model_path=model_path, what="probe-engine localize (the trainer side: HF models patched by the emulator)")
    prof_name, prof, warnings = engine_profile(engine, cap, profile, capture_file=capture_file, mode=mode,
                                               exact="exact" in trainers)
    tname = trainer_profile_name()
    rep = LocalizeReport(engine=cap["engine"], family=family, profile_name=prof_name, trainer_profile_name=tname,
                         model=model_fields(model, cap), warnings=warnings)
    if prof.available("attention"):
        from .mismatch import machine_differences

        diffs = machine_differences(cap["engine"], prof)
        if diffs:
            rep.warnings.append("exact mode ran on a machine the profile does not describe (its rows are measured, "
                                "not claimed; apply_profile(exact=True) refuses it): " + "; ".join(diffs))
    observed = set(engine_tensors(next(s for s in cap["sequences"] if all(s["layers"]))))
    rep.unobserved = [n for n in tensor_names(model.config.num_hidden_layers) if n not in observed]
    if rep.unobserved and cap["engine"].get("mode") != "eager":
        rep.warnings.append(
            f"the engine's {cap['engine'].get('mode', 'default')} mode runs each layer as one compiled graph: "
            f"{len(rep.unobserved)} tensors (the norms' outputs, the residual stream, the MLP output) are not "
            "observable there; --mode eager observes every tensor")
    trainer_prof = get_profile(tname)
    for t in trainers:
        note(f"trainer: {t}")
        rep.results.append(localize(model, cap, t, prof, trainer_prof, note=note, try_fixes=try_fixes))
    return rep
