"""Terminal tables and plots of the engine-in-the-loop results: mismatch reports and in-situ fits
(profiles and diffs are rendered by :mod:`engineprofiles.render`)."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text


def pct(x: float) -> str:
    """A fraction as a percentage that never shows a partial match as 100%."""
    if x == 1.0:
        return "100%"
    digits = 1
    s = f"{100 * x:.{digits}f}"
    while s.startswith("100") and digits < 8:
        digits += 1
        s = f"{100 * x:.{digits}f}"
    return s + "%"


def mismatch_table(rep) -> Group:
    e = rep.engine
    head = Text()
    head.append(f"{e['name']} {e['version']} ({e.get('compilation_mode', '')}, mode {e.get('mode', 'default')}) vs HF "
                f"transformers, family {rep.family}\n", style="bold")
    m = getattr(rep, "model", {}) or {}
    if m:
        head.append("model: " + ", ".join(f"{k}={v}" for k, v in m.items()) + f"; first prompt {rep.prompt_len} tokens\n")
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
            t.add_row(name, pct(m.exact_match), f"{m.k3_kl:.1e}", f"{m.abs_dp_max:.1e}", f"{m.abs_dp_mean:.1e}",
                      f"{m.abs_dlogp_mean:.1e}", f"{m.abs_dlogp_max:.1e}", f"{m.ppl_ratio:.5f}")
        parts.append(t)
    n = rep.rows[0][1].tokens if rep.rows else 0
    parts.append(Text(f"{n} sampled tokens"))
    return Group(*parts)


def check_plot_available() -> None:
    """Raise (before any work) when --plot cannot draw: matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        from engineprofiles.errors import EngineProfilesError

        raise EngineProfilesError(f"--plot needs matplotlib ({e}); pip install matplotlib, or leave out --plot") from None


def mismatch_plot(rep, path: str) -> None:
    """Draw the mismatch table as a PNG, written atomically to ``path`` (a regular file or a new path)."""
    import io

    from engineprofiles.files import write_atomic

    check_plot_available()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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
    buf = io.BytesIO()
    fig.savefig(buf, dpi=120, format="png")
    plt.close(fig)
    write_atomic(path, buf.getvalue())


def in_situ_table(fit) -> Table:
    """Bitwise match per captured tensor: the op-level start, the fitted profile, and for each
    region the best candidate with other rounding sites there (the runner-up)."""
    from engineprofiles.regions import REGIONS

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
        t.add_row(Text(str(k)), f"{100 * fit.start.layers[k].rate:.2f}%", f"{100 * v.rate:.2f}%",
                  *[f"{100 * r.layers[k].rate:.2f}%" for _, _, r in runners])
    if runners:
        t.caption = Text("\n".join(f"{name}: {p.label()}" for name, p, _ in runners))
    return t


def localize_table(rep) -> Group:
    """Per trainer: the match rate of every observed tensor in forward order (the first that differs
    marked), then the changes that move that divergence later or shrink it."""
    from .localize import PRODUCERS

    e = rep.engine
    head = Text()
    head.append(f"{e['name']} {e['version']} ({e.get('compilation_mode', '')}, mode {e.get('mode', 'default')}) vs HF "
                f"transformers, family {rep.family}\n", style="bold")
    if rep.model:
        head.append("model: " + ", ".join(f"{k}={v}" for k, v in rep.model.items()) + "\n")
    head.append(f"profile: {rep.profile_name}; trainer's own: {rep.trainer_profile_name}\n")
    for w in rep.warnings:
        head.append(f"warning: {w}\n", style="red bold")
    parts: list = [head]
    for loc in rep.results:
        first = loc.first
        t = Table(title=f"trainer {loc.trainer}: " + (f"first divergence at {first.name}" if first else
                                                       "every observed tensor bit-equal to the engine's"))
        for col in ("tensor", "bit-equal", "elements", ""):
            t.add_column(col, no_wrap=True)
        for r in loc.rows:
            mark = "<- first divergence" if first is not None and r is first else ""
            t.add_row(r.name, pct(r.rate), str(r.total) + (" (shapes differ)" if r.shape_differs else ""), mark,
                      style="bold red" if mark else None)
        parts.append(t)
        if first is None:
            continue
        kind = first.name.split(".")[-1]
        parts.append(Text(f"{first.name} is computed by {PRODUCERS[kind]}"))
        if not loc.candidates_tried:
            continue
        if not loc.fixes:
            parts.append(Text(f"none of the {loc.candidates_tried} changes tried moves the divergence later: it lies "
                              "outside what the profile's lattice (and exact mode) can change", style="yellow"))
            continue
        f = Table(title=f"changes that move it later ({len(loc.fixes)} of {loc.candidates_tried} tried)")
        for col in ("change", f"{first.name} bit-equal", "removes it", "first divergence then"):
            f.add_column(col, no_wrap=True)
        for x in loc.fixes:
            f.add_row(x.change, pct(x.rate_at_first), "yes" if x.removes else "no",
                      x.first_after or "none (all bit-equal)")
        parts.append(f)
    return Group(*parts)
