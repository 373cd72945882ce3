"""Readable renderings of profiles for the terminal (rich).

Every string that comes from a profile or from the command line is rendered as a :class:`Text`,
never parsed as rich markup: ``engine.device: '[/bold] x'`` prints as written; and with its control
characters escaped (:func:`engineprofiles.text.printable`): a ``provenance.command`` holding
``\x1b[2J`` shows those characters, it does not clear the screen.
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from .schema import Profile
from .text import printable


def _t(value: object, style: str = "") -> Text:
    """``value`` as literal text (no markup, control characters escaped)."""
    return Text(printable(str(value)), style=style)


def _pct(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 1.0:
        return "100%"
    s = f"{100 * x:.2f}"
    digits = 2
    while s.startswith("100") and digits < 12:  # never show a partial match as 100%
        digits += 2
        s = f"{100 * x:.{digits}f}"
    return s + "%"


def profile_header(p: Profile, name: str | None = None, settings: bool = True) -> Text:
    e, pv = p.engine, p.provenance
    t = Text()
    t.append(printable(f"{name or p.canonical_name}\n"), style="bold")
    t.append(printable(f"engine   {e.name} {e.version}  backend={e.backend}  device={e.device}\n"))
    t.append(printable(f"mode     {e.execution_mode}  dtype={p.dtype}  torch={e.torch_version}\n"))
    if e.settings and settings:
        t.append(printable("settings " + ", ".join(f"{k}={v}" for k, v in e.settings.items()) + "\n"))
    t.append(printable(f"probed   {pv.date}  method={pv.method}  probe v{pv.probe_version} "
                       f"(package {pv.package_version})\n"))
    t.append(printable(f"command  {pv.command}"))
    if pv.self_check is not None:
        sc = pv.self_check
        t.append(printable(f"\nself-check {'exact' if sc.exact else 'NOT exact'} on {sc.model} ({sc.sampled_tokens} sampled, "
                           f"{sc.prefill_tokens} prefill tokens): {sc.rows()}"))
    return t


def sites_table(p: Profile, wide: bool = True) -> Table:
    t = Table(title="rounding sites", show_lines=False)
    for col in ("region", "site", "choice", "meaning")[: 4 if wide else 3]:
        t.add_column(col)
    for name, spec, entry in p.entries():
        if entry.sites is None:
            t.add_row(name, "-", _t("unavailable", "red"), _t(entry.evidence.reason or ""))
            continue
        first = True
        for c in spec.sites:
            v = getattr(entry.sites, c.name)
            style = "cyan" if v == "fp32" else "yellow"
            t.add_row(name if first else "", c.name, _t(v, style), *([_t(c.doc)] if wide else []))
            first = False
        for c in spec.variants:
            t.add_row("", f"{c.name} (variant)", _t(getattr(entry.variants, c.name)), *([_t(c.doc)] if wide else []))
        t.add_section()
    return t


def evidence_table(p: Profile) -> Table:
    t = Table(title="evidence")
    for col in ("region", "match", "runner-up", "max ulp", "shapes", "flags"):
        t.add_column(col)
    for name, _, entry in p.entries():
        ev = entry.evidence
        flags = [f for f in ("ambiguous", "shape_dependent", "nondeterministic") if getattr(ev, f)]
        if ev.scope == "whole-model":
            flags.append("whole-model rate")
        if ev.status == "unavailable":
            flags.append("unavailable")
        ru = "-" if ev.runner_up is None else f"{ev.runner_up} ({_pct(ev.runner_up_match_rate)})"
        t.add_row(
            name,
            _pct(ev.match_rate),
            _t(ru),
            "-" if ev.max_ulp is None else str(ev.max_ulp),
            str(len(ev.shapes)),
            ", ".join(flags) or "-",
        )
    return t


def notes(p: Profile) -> Text:
    t = Text()
    for name, _, entry in p.entries():
        ev = entry.evidence
        if ev.path:
            t.append(printable(f"{name}: probed {ev.path}\n"))
        for n in ev.notes:
            t.append(printable(f"{name}: {n}\n"))
        if ev.indistinguishable:
            t.append(printable(f"{name}: not told apart on the probe inputs: {'; '.join(ev.indistinguishable)}\n"))
        if ev.tied_with:
            t.append(printable(f"{name}: tied with {'; '.join(ev.tied_with)}\n"),
                     style="red" if ev.ambiguous else "yellow")
    return t


def summary_table(p: Profile) -> Table:
    """One row per region: its sites and variants as ``name=choice`` (folded to the terminal), its
    match rate and the flags of its evidence (what a probe prints; the rest is in ``show``)."""
    t = Table(title="rounding sites per region (their meaning and evidence: probe-engine show)", expand=True)
    t.add_column("region", no_wrap=True)
    t.add_column("sites", overflow="fold", ratio=3)
    t.add_column("match", overflow="fold", ratio=1)
    for name, spec, entry in p.entries():
        ev = entry.evidence
        if entry.sites is None:
            t.add_row(name, _t("unavailable", "red"), _t(ev.reason or ""))
            continue
        sites = [f"{c.name}={getattr(entry.sites, c.name)}" for c in spec.sites]
        sites += [f"{c.name}={getattr(entry.variants, c.name)}" for c in spec.variants]
        flags = [f for f in ("ambiguous", "shape_dependent", "nondeterministic") if getattr(ev, f)]
        if ev.indistinguishable:
            flags.append(f"{len(ev.indistinguishable)} not told apart")
        t.add_row(name, _t(" ".join(sites)), _t(" ".join([_pct(ev.match_rate), *flags])))
    return t


def summary_group(p: Profile, name: str | None = None) -> Group:
    """What a probe prints: the header (without the engine's settings, which are in the file) and
    :func:`summary_table`."""
    return Group(profile_header(p, name, settings=False), summary_table(p))


def show_group(p: Profile, name: str | None = None, wide: bool = True) -> Group:
    """What :func:`show` prints (``wide``: the sites table with its variants column layout for >= 120 columns)."""
    return Group(profile_header(p, name), sites_table(p, wide=wide), evidence_table(p), notes(p))


def show(p: Profile, console: Console, name: str | None = None) -> None:
    console.print(show_group(p, name, wide=console.width >= 120))


def diff_table(d, summary: bool = True) -> Group:
    """The site-by-site table, the other differences, and (``summary``) the count of sites that
    differ (``probe-engine check`` prints its own verdict instead: it counts variants too)."""
    t = Table(title=_t(f"{d.a_name}  vs  {d.b_name}"))
    for col in ("region", "site", _t(d.a_name), _t(d.b_name), ""):
        t.add_column(col, overflow="fold")
    for r in d.rows:
        if r.same:
            mark = _t("")
        elif r.kind == "variant":
            mark = _t("differs (variant)", "yellow")
        else:
            mark = _t("differs", "red bold")
        name = r.name if r.kind != "variant" else f"{r.name} (variant)"
        t.add_row(_t(r.region), _t(name), _t(r.a), _t(r.b), mark)
    parts: list = [t]
    if d.context:
        c = Table(title="other differences (not rounding sites)")
        for col in ("field", _t(d.a_name), _t(d.b_name)):
            c.add_column(col, overflow="fold")
        for f, a, b in d.context:
            c.add_row(_t(f), _t(a), _t(b))
        parts.append(c)
    if not summary:
        return Group(*parts)
    n = len(d.site_differences)
    parts.append(Text("all rounding sites agree" if n == 0 else f"{n} rounding site(s) differ",
                      style="green" if n == 0 else "red bold"))
    return Group(*parts)
