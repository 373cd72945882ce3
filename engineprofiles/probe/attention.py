"""Attention, black box: which point of the attention lattice reproduces an engine's outputs.

The probe sees only what the engine's attention took and returned: q, k, v and the output, for
prefill calls (every query of a sequence) and decode calls (one query against the keys cached
so far). :func:`fit_attention` searches the lattice (``engineprofiles.regions.attention``) one
choice at a time from a starting point, keeps the point that matches the most output elements
bit for bit (ties keep the current point), and records the evidence as for the regions: the
winner's match rate per path, the runner-up, the largest ULP distance of what is left, the points
that tied. Points are searched, not enumerated (the lattice has 12,960), so the evidence says how
many were tried.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..regions import ATTENTION_SPEC, Point, attention_ref
from ..rounding import ulp_distance


@dataclass
class AttentionSample:
    """One attention call (or several decode calls of one sequence stacked): engine layout."""

    q: torch.Tensor  # [Tq, Hq, D]
    k: torch.Tensor  # [Tk, Hk, D]
    v: torch.Tensor  # [Tk, Hk, D]
    out: torch.Tensor  # [Tq, Hq, D], what the engine returned
    scale: float
    path: str  # "prefill" | "decode"
    mask: torch.Tensor | None = None  # [Tq, Tk] bool; None: causal, queries the last Tq positions

    @property
    def shape(self) -> str:
        return (f"{self.path}: tq={self.q.shape[0]},tk={self.k.shape[0]},q_heads={self.q.shape[1]},"
                f"kv_heads={self.k.shape[1]},head_dim={self.q.shape[2]}")


# Known kernels' points, where a search that ends short of a bitwise match from ``start`` begins again.
KERNEL_STARTS = (
    ("vLLM's CPU attention kernel", ATTENTION_SPEC.point(dict(logits="fp32", probs="fp32"), dict(
        scale="query", qk_dot="fma", exp="poly5_fma", row_sum="lanes16_tree", pv_dot="fma",
        normalize="reciprocal_f64"))),
    ("torch's CPU flash attention (AVX512, BF16/FP16)", ATTENTION_SPEC.point(dict(logits="fp32", probs="rounded"), dict(
        scale="logits", qk_dot="matmul", exp="vec16_fexp_u20", row_sum="vec16_tree_tail", pv_dot="matmul",
        normalize="reciprocal_f64"))),
    ("vLLM's CPU attention kernel, AVX2 build", ATTENTION_SPEC.point(dict(logits="fp32", probs="fp32"), dict(
        scale="query", qk_dot="mul_add", exp="glibc_expf", row_sum="lanes16_halves_sequential", pv_dot="mul_add",
        normalize="reciprocal_f64", output="truncate"))),
)


@dataclass
class Score:
    matched: int = 0
    total: int = 0
    max_ulp: int = 0
    per_path: dict[str, list[int]] = field(default_factory=dict)  # path -> [matched, total]

    @property
    def rate(self) -> float:
        return self.matched / self.total if self.total else float("nan")


def score(point: Point, samples: list[AttentionSample]) -> Score:
    s = Score()
    for smp in samples:
        ref = attention_ref(smp.q, smp.k, smp.v, point, scale=smp.scale, mask=smp.mask)
        eng = smp.out.reshape(ref.shape).to(ref.dtype)
        same = (ref == eng) | (torch.isnan(ref) & torch.isnan(eng))
        m, n = int(same.sum()), same.numel()
        s.matched += m
        s.total += n
        if m < n:
            s.max_ulp = max(s.max_ulp, int(ulp_distance(ref[~same], eng[~same]).max()))
        pp = s.per_path.setdefault(smp.path, [0, 0])
        pp[0] += m
        pp[1] += n
    return s


# Where the search starts unless told otherwise: FP32 torch attention rounded once (torch's own
# matmuls, exp and sum, a division at the end), which assumes nothing about any engine's kernel.
START = ATTENTION_SPEC.point(dict(logits="fp32", probs="fp32"), dict(
    scale="logits", qk_dot="matmul", exp="torch", row_sum="torch", pv_dot="matmul", normalize="divide"))


@dataclass
class AttentionFit:
    point: Point
    score: Score
    tried: dict[Point, Score]

    def evidence(self, path: str, notes: list[str] | None = None) -> dict:
        """The profile's evidence for the winner (schema.Evidence fields)."""
        spec, win, best = ATTENTION_SPEC, self.point, self.score
        others = sorted(((s.matched, p) for p, s in self.tried.items() if p != win), key=lambda x: -x[0])
        tied = [p for m, p in others if m == best.matched]
        tied_sites = [p.label() for p in tied if spec.site_part(p) != spec.site_part(win)]
        tied_variants = [p.label() for p in tied if spec.site_part(p) == spec.site_part(win)]
        runner = next(((m, p) for m, p in others if m < best.matched), None) or (others[0] if others else None)
        return dict(
            path=path,
            match_rate=best.rate,
            runner_up=runner[1].label() if runner else None,
            runner_up_match_rate=(runner[0] / best.total) if runner else None,
            max_ulp=best.max_ulp,
            elements=best.total,
            shapes=sorted({k for k in self.shapes}),
            ambiguous=bool(tied_sites),
            tied_with=tied_sites,
            indistinguishable=tied_variants,
            per_shape=[dict(shape=k, winner=win.label(), match_rate=m / n) for k, (m, n) in sorted(best.per_path.items())],
            notes=[f"coordinate search over the attention lattice (pairs of choices changed together where one at a "
                   f"time fell short): {len(self.tried)} points scored on every call"] + list(notes or []),
        )

    shapes: list[str] = field(default_factory=list)


class _Search:
    """The coordinate and pair search of :func:`fit_attention` over the attention lattice, with every
    point's score on ``samples`` memoized (``tried``) and the pair screen's on the first few (``screened``)."""

    def __init__(self, samples: list[AttentionSample], passes: int, note: Callable[[str], None], pair_screen: int):
        self.samples, self.passes, self.note = samples, passes, note
        self.few = samples[:pair_screen]
        self.tried: dict[Point, Score] = {}
        self.screened: dict[Point, int] = {}

    def run(self, p: Point) -> Score:
        if p not in self.tried:
            self.tried[p] = score(p, self.samples)
        return self.tried[p]

    def exact(self, p: Point) -> bool:
        return self.tried[p].matched == self.tried[p].total

    def coordinate(self, current: Point) -> Point:
        for _ in range(self.passes):
            changed = False
            for c in ATTENTION_SPEC.choices:
                best_p, best_s = current, self.run(current)
                for o in c.options:
                    p = current.replace(**{c.name: o})
                    s = self.run(p)
                    if s.matched > best_s.matched:
                        best_p, best_s = p, s
                if best_p != current:
                    self.note(f"attention: {c.name} -> {best_p[c.name]} ({best_s.rate:.4%} of output elements match)")
                    current = best_p
                    changed = True
            if not changed or self.exact(current):
                break
        return current

    def pairs(self, current: Point) -> Point | None:
        choices = ATTENTION_SPEC.choices
        base = self.screened.setdefault(current, score(current, self.few).matched)
        best, best_m = None, base
        for i, a in enumerate(choices):
            for b in choices[i + 1:]:
                for oa in a.options:
                    for ob in b.options:
                        if oa == current[a.name] or ob == current[b.name]:
                            continue
                        p = current.replace(**{a.name: oa, b.name: ob})
                        if p not in self.screened:
                            self.screened[p] = score(p, self.few).matched
                        if self.screened[p] > best_m:
                            best, best_m = p, self.screened[p]
        return best

    def search(self, begin: Point) -> Point:
        current = self.coordinate(begin)
        while not self.exact(current):
            cand = self.pairs(current)
            if cand is None or self.run(cand).matched <= self.tried[current].matched:
                break
            self.note(f"attention: {cand.label()} changed together ({self.tried[cand].rate:.4%} of output elements match)")
            current = self.coordinate(cand)
        return current


def fit_attention(samples: list[AttentionSample], *, start: Point = START, passes: int = 2,
                  note: Callable[[str], None] = lambda m: None, pair_screen: int = 3) -> AttentionFit:
    """Coordinate search: for each site and variant in turn, every option with the others fixed;
    keep the best (ties keep the current option); until a pass changes nothing, at most ``passes``.
    Choices can depend on each other (rounding the weights matters only once they are normalized
    where the engine normalizes them), so when that ends short of a bitwise match, every pair of
    choices is changed together: screened on the first ``pair_screen`` samples, the best pair
    scored on all, and the coordinate search resumes from it while that improves the match."""
    if not samples:
        raise ValueError("fit_attention needs at least one captured attention call")
    srch = _Search(samples, passes, note, pair_screen)
    current = srch.search(start)
    # Short of a bitwise match, the search may sit in a local optimum: search again from each known
    # kernel's point and keep the best (a start is only where the search begins; scores decide).
    for name, begin in KERNEL_STARTS:
        if srch.exact(current):
            break
        if begin == start:
            continue
        note(f"attention: searching again from {name}'s point")
        cand = srch.search(begin)
        if srch.tried[cand].matched > srch.tried[current].matched:
            current = cand
    # Where the samples cannot tell the winner from a known kernel's point, that point is kept: it also
    # describes the kernel on inputs the probe did not try (the others stay listed as indistinguishable).
    for name, known in KERNEL_STARTS:
        if known != current and srch.run(known).matched == srch.tried[current].matched:
            note(f"attention: {name}'s point matches as many elements ({srch.tried[known].rate:.4%}); keeping it")
            current = known
            break
    fit = AttentionFit(current, srch.tried[current], srch.tried)
    fit.shapes = sorted({s.shape for s in samples})
    return fit


# (label, queries, keys, q heads, kv heads, head dim, q/k spread): prefill (queries = keys), decode
# (one query against a cache), a chunk of queries at the end of a longer sequence; head dims 64 and
# 128, GQA and MHA; sharp and flat softmaxes (the spread sets the logits' range); sequences past
# 256 keys so that sums run over many 16-wide chunks. QUICK keeps the first four.
ATTENTION_CASES = (
    ("prefill", 7, 7, 4, 2, 64, 1.3),
    ("decode", 1, 17, 4, 2, 64, 1.3),
    ("prefill", 33, 33, 8, 2, 128, 0.4),
    ("chunk", 5, 70, 4, 2, 64, 2.0),
    ("decode", 1, 200, 8, 2, 128, 1.0),
    ("prefill", 130, 130, 4, 1, 64, 1.0),
    ("decode", 1, 300, 2, 2, 64, 0.3),
    ("prefill", 300, 300, 2, 2, 64, 1.5),
)


def attention_inputs(dtype: torch.dtype, seed: int, quick: bool = False, extra: tuple[tuple, ...] = ()):
    """(path, q, k, v, scale) per probe case, in the engine layout, rounded to ``dtype``: q and k
    with a few outlier tokens (large logits, so a few keys dominate), v with outlier channels.
    ``extra``: an adapter's own cases after the standard ones (left out with ``quick``)."""
    g = torch.Generator().manual_seed(seed + 7919)
    for path, tq, tk, hq, hk, d, spread in ATTENTION_CASES[: 4 if quick else None] + (() if quick else tuple(extra)):
        q = torch.randn(tq, hq, d, generator=g) * spread
        k = torch.randn(tk, hk, d, generator=g) * spread
        v = torch.randn(tk, hk, d, generator=g)
        k[torch.randint(0, tk, (max(1, tk // 16),), generator=g)] *= 4.0
        v[..., torch.randint(0, d, (2,), generator=g)] *= 16.0
        yield ("decode" if path == "decode" else "prefill"), q.to(dtype), k.to(dtype), v.to(dtype), d ** -0.5


def probe_attention(fn: Callable[..., torch.Tensor], dtype: torch.dtype, seed: int, quick: bool = False,
                    progress: Callable[[str], None] | None = None,
                    extra: tuple[tuple, ...] = ()) -> tuple[AttentionFit, bool]:
    """Run the engine's attention ``fn(q, k, v, scale=...)`` (causal, the queries the last positions)
    twice on every probe case (and the adapter's ``extra`` cases) and fit the lattice. Returns the fit
    and whether two identical runs differed."""
    samples, nondet = [], False
    for path, q, k, v, scale in attention_inputs(dtype, seed, quick, extra):
        first = fn(q.clone(), k.clone(), v.clone(), scale=scale).detach().to("cpu")
        second = fn(q.clone(), k.clone(), v.clone(), scale=scale).detach().to("cpu")
        nondet |= not bool(((first == second) | (torch.isnan(first) & torch.isnan(second))).all())
        samples.append(AttentionSample(q, k, v, first.reshape(q.shape), scale, path))
    if progress:
        progress(f"attention: fitting {len(samples)} calls against the attention lattice")
    return fit_attention(samples, note=progress or (lambda m: None)), nondet
