"""Readable renderings of profiles for the terminal (rich)."""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from .regions import REGIONS
from .schema import Profile


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


def profile_header(p: Profile, name: str | None = None) -> Text:
    e, pv = p.engine, p.provenance
    t = Text()
    t.append(f"{name or p.canonical_name}\n", style="bold")
    t.append(f"engine   {e.name} {e.version}  backend={e.backend}  device={e.device}\n")
    t.append(f"mode     {e.execution_mode}  dtype={p.dtype}  torch={e.torch_version}\n")
    if e.settings:
        t.append("settings " + ", ".join(f"{k}={v}" for k, v in e.settings.items()) + "\n")
    t.append(f"probed   {pv.date}  method={pv.method}  probe v{pv.probe_version} (package {pv.package_version})\n")
    t.append(f"command  {pv.command}")
    return t


def sites_table(p: Profile, wide: bool = True) -> Table:
    t = Table(title="rounding sites", show_lines=False)
    for col in ("region", "site", "choice", "meaning")[: 4 if wide else 3]:
        t.add_column(col)
    for name, spec in REGIONS.items():
        entry = p.entry(name)
        if entry.sites is None:
            t.add_row(name, "-", "[red]unavailable[/red]", entry.evidence.reason or "")
            continue
        first = True
        for c in spec.sites:
            v = getattr(entry.sites, c.name)
            style = "cyan" if v == "fp32" else "yellow"
            t.add_row(name if first else "", c.name, f"[{style}]{v}[/{style}]", *([c.doc] if wide else []))
            first = False
        for c in spec.variants:
            t.add_row("", f"{c.name} (variant)", getattr(entry.variants, c.name), *([c.doc] if wide else []))
        t.add_section()
    return t


def evidence_table(p: Profile) -> Table:
    t = Table(title="evidence")
    for col in ("region", "match", "runner-up", "max ulp", "shapes", "flags"):
        t.add_column(col)
    for name in REGIONS:
        ev = p.entry(name).evidence
        flags = [f for f in ("ambiguous", "shape_dependent", "nondeterministic") if getattr(ev, f)]
        if ev.status == "unavailable":
            flags.append("unavailable")
        ru = "-" if ev.runner_up is None else f"{ev.runner_up} ({_pct(ev.runner_up_match_rate)})"
        t.add_row(
            name,
            _pct(ev.match_rate),
            ru,
            "-" if ev.max_ulp is None else str(ev.max_ulp),
            str(len(ev.shapes)),
            ", ".join(flags) or "-",
        )
    return t


def notes(p: Profile) -> Text:
    t = Text()
    for name in REGIONS:
        ev = p.entry(name).evidence
        if ev.path:
            t.append(f"{name}: probed {ev.path}\n")
        for n in ev.notes:
            t.append(f"{name}: {n}\n")
        if ev.indistinguishable:
            t.append(f"{name}: not told apart on the probe inputs: {'; '.join(ev.indistinguishable)}\n")
        if ev.tied_with:
            t.append(f"{name}: tied with {'; '.join(ev.tied_with)}\n", style="red" if ev.ambiguous else "yellow")
    return t


def show(p: Profile, console: Console, name: str | None = None) -> None:
    console.print(Group(profile_header(p, name), sites_table(p, wide=console.width >= 120), evidence_table(p), notes(p)))


def diff_table(d) -> Group:
    t = Table(title=f"{d.a_name}  vs  {d.b_name}")
    for col in ("region", "site", d.a_name, d.b_name, ""):
        t.add_column(col, overflow="fold")
    for r in d.rows:
        if r.same:
            mark = ""
        elif r.kind == "variant":
            mark = "[yellow]differs (variant)[/yellow]"
        else:
            mark = "[red bold]differs[/red bold]"
        name = r.name if r.kind != "variant" else f"{r.name} (variant)"
        t.add_row(r.region, name, r.a, r.b, mark)
    parts: list = [t]
    if d.context:
        c = Table(title="other differences (not rounding sites)")
        for col in ("field", d.a_name, d.b_name):
            c.add_column(col, overflow="fold")
        for f, a, b in d.context:
            c.add_row(f, a, b)
        parts.append(c)
    n = len(d.site_differences)
    parts.append(Text("all rounding sites agree" if n == 0 else f"{n} rounding site(s) differ",
                      style="green" if n == 0 else "red bold"))
    return Group(*parts)


def mismatch_table(rep) -> Group:
    e = rep.engine
    head = Text()
    head.append(f"{e['name']} {e['version']} ({e.get('compilation_mode', '')}) vs HF transformers, family {rep.family}\n",
                style="bold")
    head.append(f"profile applied: {rep.profile_name}; trainer's own: {rep.trainer_profile_name}\n")
    for w in rep.warnings:
        head.append(f"warning: {w}\n", style="red bold")
    parts: list = [head]
    for title, rows in (("sampled tokens (engine decode log-probs)", rep.rows),
                        ("every token re-scored in one prefill (engine prompt log-probs)", rep.prefill_rows)):
        t = Table(title=title)
        for col in ("trainer", "exact", "k3 KL", "|dp| max", "|dp| mean", "|dlogp| mean", "|dlogp| max", "PPL ratio"):
            t.add_column(col, no_wrap=True, min_width=22 if col == "trainer" else None)
        for name, m in rows:
            t.add_row(name, f"{100 * m.exact_match:.1f}%", f"{m.k3_kl:.1e}", f"{m.abs_dp_max:.1e}", f"{m.abs_dp_mean:.1e}",
                      f"{m.abs_dlogp_mean:.1e}", f"{m.abs_dlogp_max:.1e}", f"{m.ppl_ratio:.5f}")
        parts.append(t)
    n = rep.rows[0][1].tokens if rep.rows else 0
    parts.append(Text(f"{n} sampled tokens"))
    return Group(*parts)


def mismatch_plot(rep, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        from .errors import EngineProfilesError

        raise EngineProfilesError(f"--plot needs matplotlib ({e}); pip install matplotlib") from None
    names = [n for n, _ in rep.rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
    axes[0].barh(names, [100 * m.exact_match for _, m in rep.rows])
    axes[0].set_xlabel("exact-match fraction of sampled-token log-probs (%)")
    axes[1].barh(names, [m.abs_dlogp_mean for _, m in rep.rows])
    axes[1].set_xlabel("mean |logp_train - logp_engine|")
    axes[1].set_yticklabels([])
    axes[1].ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
    e = rep.engine
    fig.suptitle(f"{e['name']} {e['version']} vs HF trainer ({rep.family})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def in_situ_table(fit) -> Table:
    """Bitwise match per captured tensor: the op-level start, the fitted profile, and for each
    region the best candidate with other rounding sites there (the runner-up)."""
    from .regions import REGIONS

    runners = []
    for region, results in fit.candidates.items():
        spec = REGIONS[region]
        win = fit.points[region]
        others = [(r.total.matched, p, r) for p, r in results if spec.site_part(p) != spec.site_part(win)]
        if others:
            m, p, r = max(others, key=lambda x: x[0])
            runners.append((f"runner-up {region}", p, r))
    t = Table(title="in situ: bitwise match per captured tensor")
    t.add_column("tensor")
    t.add_column("op-level start")
    t.add_column("in-situ fit")
    for name, _, _ in runners:
        t.add_column(name)
    for k, v in fit.best.layers.items():
        t.add_row(k, f"{100 * fit.start.layers[k].rate:.2f}%", f"{100 * v.rate:.2f}%",
                  *[f"{100 * r.layers[k].rate:.2f}%" for _, _, r in runners])
    for name, p, _ in runners:
        t.caption = (t.caption + "\n" if t.caption else "") + f"{name}: {p.label()}"
    return t
