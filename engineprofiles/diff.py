"""Site-by-site comparison of two profiles.

Sites decide the exit status; formula variants, evidence, engine and provenance differences are
shown but are not site differences. A region available in one profile and unavailable in the
other counts as a site difference (one side cannot be emulated). Attention (what exact mode
consumes) is compared the same way, after the regions.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from .regions import BESIDE
from .schema import Profile


@dataclass
class Row:
    region: str
    name: str
    kind: str  # site | variant | availability
    a: str
    b: str

    @property
    def same(self) -> bool:
        return self.a == self.b


@dataclass
class Diff:
    a_name: str
    b_name: str
    rows: list[Row] = field(default_factory=list)
    context: list[tuple[str, str, str]] = field(default_factory=list)  # (field, a, b) that differ

    @property
    def site_differences(self) -> list[Row]:
        return [r for r in self.rows if not r.same and r.kind in ("site", "availability")]

    @property
    def variant_differences(self) -> list[Row]:
        return [r for r in self.rows if not r.same and r.kind == "variant"]

    @property
    def exit_code(self) -> int:
        return 1 if self.site_differences else 0

    def to_json(self) -> str:
        return json.dumps(
            {
                "a": self.a_name,
                "b": self.b_name,
                "sites_agree": not self.site_differences,
                "rows": [dict(asdict(r), same=r.same) for r in self.rows],
                "context": [dict(field=f, a=a, b=b) for f, a, b in self.context],
            },
            indent=2,
        )

    def to_markdown(self) -> str:
        lines = [f"| region | site | {self.a_name} | {self.b_name} | |", "|---|---|---|---|---|"]
        for r in self.rows:
            mark = "" if r.same else ("**differs**" if r.kind != "variant" else "differs (variant)")
            name = r.name if r.kind != "variant" else f"{r.name} (variant)"
            lines.append(f"| {r.region} | {name} | {r.a} | {r.b} | {mark} |")
        if self.context:
            lines += ["", "| other field | " + self.a_name + " | " + self.b_name + " |", "|---|---|---|"]
            lines += [f"| {f} | {a} | {b} |" for f, a, b in self.context]
        n = len(self.site_differences)
        lines += ["", "All rounding sites agree." if n == 0 else f"{n} rounding site(s) differ."]
        return "\n".join(lines) + "\n"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def diff_profiles(a: Profile, b: Profile, a_name: str = "A", b_name: str = "B") -> Diff:
    d = Diff(a_name, b_name)
    for (name, spec, ea), (_, _, eb) in zip(a.entries(), b.entries()):
        if ea.sites is None or eb.sites is None:
            sa = "available" if ea.sites is not None else f"unavailable ({ea.evidence.reason})"
            sb = "available" if eb.sites is not None else f"unavailable ({eb.evidence.reason})"
            d.rows.append(Row(name, "(region)", "availability", sa, sb))
            if ea.sites is None or eb.sites is None:
                continue
        for c in spec.sites:
            d.rows.append(Row(name, c.name, "site", getattr(ea.sites, c.name), getattr(eb.sites, c.name)))
        for c in spec.variants:
            d.rows.append(Row(name, c.name, "variant", getattr(ea.variants, c.name), getattr(eb.variants, c.name)))
    for f in ("name", "version", "backend", "device", "torch_version", "execution_mode"):
        va, vb = getattr(a.engine, f), getattr(b.engine, f)
        if va != vb:
            d.context.append((f"engine.{f}", _fmt(va), _fmt(vb)))
    if a.dtype != b.dtype:
        d.context.append(("dtype", a.dtype, b.dtype))
    for k in sorted(set(a.engine.settings) | set(b.engine.settings)):
        va, vb = a.engine.settings.get(k, "-"), b.engine.settings.get(k, "-")
        if va != vb:
            d.context.append((f"engine.settings.{k}", _fmt(va), _fmt(vb)))
    for (name, _, ea), (_, _, eb) in zip(a.entries(), b.entries()):
        where = name if name in BESIDE else f"regions.{name}"
        for f in ("match_rate", "max_ulp", "ambiguous", "shape_dependent", "nondeterministic"):
            va, vb = getattr(ea.evidence, f), getattr(eb.evidence, f)
            if va != vb:
                d.context.append((f"{where}.evidence.{f}", _fmt(va), _fmt(vb)))
    for f in ("method", "probe_version", "date"):
        va, vb = getattr(a.provenance, f), getattr(b.provenance, f)
        if va != vb:
            d.context.append((f"provenance.{f}", _fmt(va), _fmt(vb)))
    return d
