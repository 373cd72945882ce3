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


# The mismatch tables' columns; a terminal narrower than all of them gets NARROW (never every column cut).
COLUMNS = ("trainer", "exact", "k3 KL", "|dp| max", "|dp| mean", "|dlogp| mean", "|dlogp| max", "PPL ratio")
NARROW = ("trainer", "exact", "k3 KL", "|dlogp| max")


def _metric_cells(m) -> dict[str, str]:
    return {"exact": pct(m.exact_match), "k3 KL": f"{m.k3_kl:.1e}", "|dp| max": f"{m.abs_dp_max:.1e}",
            "|dp| mean": f"{m.abs_dp_mean:.1e}", "|dlogp| mean": f"{m.abs_dlogp_mean:.1e}",
            "|dlogp| max": f"{m.abs_dlogp_max:.1e}", "PPL ratio": f"{m.ppl_ratio:.5f}"}


def mismatch_table(rep, narrow: bool = False) -> Group:
    """The mismatch report: its head, a table of sampled and one of re-scored tokens (every metric;
    ``narrow``: :data:`NARROW` only, for an 80-column terminal), the batch check where there is one."""
    e = rep.engine
    head = Text()
    head.append(f"{e['name']} {e['version']} ({e.get('compilation_mode', '')}, mode {e.get('mode', 'default')}) vs HF "
                f"transformers, family {rep.family}\n", style="bold")
    m = getattr(rep, "model", {}) or {}
    if m:
        head.append("model: " + ", ".join(f"{k}={v}" for k, v in m.items()) + f"; first prompt {rep.prompt_len} tokens\n")
    head.append(f"profile applied: {rep.profile_name}; trainer's own: {rep.trainer_profile_name}\n")
    if getattr(rep, "logprobs", ""):
        head.append(f"engine log-probs: {rep.logprobs}\n")
    for w in rep.warnings:
        head.append(f"warning: {w}\n", style="red bold")
    parts: list = [head]
    for title, rows in (("sampled tokens (engine decode log-probs)", rep.rows),
                        ("every token re-scored in one prefill (engine prompt log-probs)", rep.prefill_rows)):
        cols = NARROW if narrow else COLUMNS
        t = Table(title=title)
        for col in cols:
            t.add_column(col, no_wrap=col != "trainer", min_width=22 if col == "trainer" else None)
        for name, m in rows:
            cells = _metric_cells(m)
            t.add_row(name, *(cells[c] for c in cols[1:]))
        parts.append(t)
    n = rep.rows[0][1].tokens if rep.rows else 0
    parts.append(Text(f"{n} sampled tokens" + ("; narrow terminal: every column with --json FILE or a wider one"
                                               if narrow else "")))
    bc = getattr(rep, "batch_check", None)
    if bc:
        parts.append(batch_table(bc))
    return Group(*parts)


def batch_table(bc: dict) -> Group:
    """The batch check: the engine's log-probs of the same sequences in other batch compositions,
    against each scored alone, and the verdict."""
    t = Table(title="the engine against itself: the same sequences in other batch compositions (vs each alone)")
    t.add_column("composition", min_width=18)
    t.add_column("seqs/call", no_wrap=True)
    t.add_column("tokens/forward", min_width=12, max_width=16, overflow="fold")
    t.add_column("bit-equal", no_wrap=True)
    t.add_column("|dlogp| max", no_wrap=True)
    for r in bc["rows"]:
        fw = r["forward_tokens"]
        shown = " ".join(map(str, fw[:4])) + (f" ... ({len(fw)} forwards)" if len(fw) > 4 else "")
        calls = sorted(set(r["requests_per_call"]))
        eq = f"{r['equal']}/{r['tokens']}" + (f", {r['diverged']} diverged" if r.get("diverged") else "")
        t.add_row(r["composition"] + (" (decode)" if r["kind"] == "decode" else ""), "/".join(map(str, calls)), shown,
                  eq, f"{r['abs_dlogp_max']:.1e}")
    ok = bc["batch_invariant"]
    verdict = Text("engine batch-invariant: " + ("yes: every log-prob bit-equal in every composition" if ok else
                   "NO: its log-probs change with the batch"), style="green bold" if ok else "red bold")
    if not bc.get("exact"):
        return Group(t, verdict)
    x = Table(title="exact mode against the engine's batched decode (each sequence in one forward, split-KV as "
                    "sampled alone / together: emulator.as_sampled)")
    x.add_column("engine run", min_width=18)
    x.add_column("trainer", min_width=18)
    x.add_column("exact match", no_wrap=True)
    x.add_column("|dlogp| max", no_wrap=True)
    for r in bc["exact"]:
        x.add_row(r["composition"], r["trainer"], f"{r['exact_match']:.1%} of {r['tokens']}", f"{r['abs_dlogp_max']:.1e}")
    return Group(t, verdict, x)


def check_plot_available(option: str = "--plot") -> None:
    """Raise (before any work) when a plot cannot be drawn: matplotlib (the ``plot`` extra) is missing."""
    from engineprofiles.extras import require

    require("plot", option)


def load_mismatch(path: str):
    """A mismatch result saved by ``probe-engine mismatch --json`` as a :class:`~engineloop.mismatch.Report`.
    A file that is not one is an :class:`~engineprofiles.errors.ArgumentError` naming the file and the field."""
    import json
    import stat
    from pathlib import Path

    from engineprofiles.errors import ArgumentError
    from engineprofiles.metrics import Mismatch

    from .mismatch import Report

    p = Path(path)
    try:  # every OS error is a message naming the file, never a traceback
        st = p.stat()
        if stat.S_ISDIR(st.st_mode):
            raise ArgumentError(f"{path}: a folder, not a mismatch result (the file of probe-engine mismatch ... --json "
                                "FILE)")
        if not stat.S_ISREG(st.st_mode):
            raise ArgumentError(f"{path}: not a regular file (a mismatch result is the file of probe-engine mismatch ... "
                                "--json FILE)")
        if st.st_size > 64 * 1024 * 1024:
            raise ArgumentError(f"{path}: {st.st_size} bytes is too large for a mismatch result")
        raw = p.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        raise ArgumentError(f"{path}: no such file (a mismatch result: probe-engine mismatch ... --json FILE)") from None
    except OSError as e:
        raise ArgumentError(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ArgumentError(f"{path}: not a mismatch result (not UTF-8 text)") from None
    except json.JSONDecodeError as e:
        raise ArgumentError(f"{path}: not a mismatch result (invalid JSON: {e})") from None
    except RecursionError:
        raise ArgumentError(f"{path}: not a mismatch result (JSON nested too deep to read; a result nests a few "
                            "levels)") from None
    if not isinstance(data, dict):
        raise ArgumentError(f"{path}: not a mismatch result (a JSON object written by probe-engine mismatch --json is "
                            f"expected, got a {type(data).__name__})")
    fields = list(Mismatch.__dataclass_fields__)

    def rows(key: str) -> list:
        out = []
        items = data.get(key)
        if not isinstance(items, list) or not items:
            raise ArgumentError(f"{path}: field {key!r}: a non-empty list of rows is expected")
        for i, r in enumerate(items):
            where = f"{key}[{i}]"
            if not isinstance(r, dict) or not isinstance(r.get("trainer"), str):
                raise ArgumentError(f"{path}: field {where}: an object with a 'trainer' name is expected")
            missing = [f for f in fields if f not in r]
            if missing:
                raise ArgumentError(f"{path}: field {where}: missing {', '.join(missing)}")
            bad = [f for f in fields if isinstance(r[f], bool) or not isinstance(r[f], (int, float))]
            if bad:
                raise ArgumentError(f"{path}: field {where}.{bad[0]}: a number is expected, got {_brief(r[bad[0]])}")
            for f in fields:  # the values a mismatch can have, not only their types
                v, what = r[f], _value_problem(f, r[f])
                if what:
                    raise ArgumentError(f"{path}: field {where}.{f}: {what}, got {_brief(v)}")
            out.append((r["trainer"], Mismatch(**{f: r[f] for f in fields})))
        return out

    warnings = data.get("warnings")
    if warnings is not None and (not isinstance(warnings, list) or not all(isinstance(w, str) for w in warnings)):
        raise ArgumentError(f"{path}: field 'warnings': a list of strings is expected, got {_brief(warnings)}")

    engine = data.get("engine")
    if not isinstance(engine, dict) or not all(isinstance(engine.get(k), str) for k in ("name", "version")):
        raise ArgumentError(f"{path}: field 'engine': an object with the engine's name and version is expected")
    return Report(engine=engine, family=str(data.get("family", "?")), profile_name=str(data.get("profile", "?")),
                  trainer_profile_name=str(data.get("trainer_profile", "?")),
                  warnings=list(warnings or []), rows=rows("sampled"),
                  prefill_rows=rows("prefill"), model=data.get("model") if isinstance(data.get("model"), dict) else {},
                  prompt_len=data.get("prompt_len", 0), command=str(data.get("command", "")),
                  engine_decode_equals_prefill=data.get("engine_decode_equals_prefill"),
                  logprobs=data["engine_logprobs"] if isinstance(data.get("engine_logprobs"), str) else "",
                  batch_check=data.get("batch_check") if isinstance(data.get("batch_check"), dict) else None)


def _brief(v) -> str:
    from engineprofiles.safeyaml import short

    return short(v, 80)


def _value_problem(field: str, v) -> str | None:
    """What is wrong with the value ``v`` of a mismatch row's ``field`` (a number), or None."""
    import math

    if field == "tokens":
        return None if isinstance(v, int) and v >= 1 else "a positive whole number of tokens is expected"
    if not math.isfinite(v):
        return "a finite number is expected"
    if field == "exact_match" and not 0.0 <= v <= 1.0:
        return "a fraction from 0 to 1 is expected"
    if v < 0:
        return "a number >= 0 is expected (a mean or maximum of non-negative values)"
    return None


MAX_PLOT_ROWS = 30  # trainer rows drawn per panel: the canvas stays bounded (13 x 26.6 in at most)
MAX_LABEL = 60  # characters of a trainer label drawn


def rows_left_out(rep) -> int:
    """How many rows of the larger panel :func:`mismatch_png` leaves out (beyond MAX_PLOT_ROWS)."""
    return max(0, len(rep.rows) - MAX_PLOT_ROWS, len(rep.prefill_rows) - MAX_PLOT_ROWS)


def mismatch_plot(rep, path: str) -> None:
    """:func:`mismatch_png`, written atomically to ``path`` (a regular file or a new path)."""
    from engineprofiles.files import write_atomic

    write_atomic(path, mismatch_png(rep))


def mismatch_png(rep) -> bytes:
    """Draw a mismatch report as a PNG (its bytes): one row of panels for the sampled tokens (the engine's decode log-probs) and one for every token
    re-scored in one prefill; exact-match fraction (linear, 0-100%) and k3 KL (log scale; a bit-exact
    row's 0 is written out, as a log axis cannot show it); each bar labelled with its value. At most
    MAX_PLOT_ROWS rows per panel are drawn (the title says how many of how many); every text is drawn
    literally (a '$' in a label is no mathtext), a label cut to MAX_LABEL characters."""
    check_plot_available()
    import matplotlib

    matplotlib.use("Agg")
    with matplotlib.rc_context({"text.parse_math": False}):
        return _mismatch_png(rep)


def _label(name: str) -> str:
    return name if len(name) <= MAX_LABEL else name[:MAX_LABEL - 3] + "..."


def _mismatch_png(rep) -> bytes:
    import io
    import math

    import matplotlib.pyplot as plt

    panels = [("sampled tokens (engine decode)", rep.rows), ("re-scored in one prefill (engine prompt log-probs)",
                                                             rep.prefill_rows)]
    panels = [(t + (f" (the first {MAX_PLOT_ROWS} of {len(r)} rows)" if len(r) > MAX_PLOT_ROWS else ""),
               [(_label(name), m) for name, m in r[:MAX_PLOT_ROWS]]) for t, r in panels if r]
    n = max(len(r) for _, r in panels)
    # One k3 scale for both rows of panels (log: from a decade below the smallest positive value).
    positive = [m.k3_kl for _, rows in panels for _, m in rows if m.k3_kl > 0]
    floor = 10 ** math.floor(math.log10(min(positive)) - 1) if positive else 1e-12
    top = 10 ** math.ceil(math.log10(max(positive)) + 1) if positive else 1e-9
    fig, axes = plt.subplots(len(panels), 2, figsize=(13, 1.4 + 0.42 * n * len(panels)), squeeze=False)
    for row, (title, rows) in enumerate(panels):
        names = [name for name, _ in rows][::-1]
        ms = [m for _, m in rows][::-1]
        ax = axes[row][0]
        vals = [100 * m.exact_match for m in ms]
        ax.barh(names, vals, color="tab:green")
        ax.set_xlim(0, 118)
        ax.set_xticks([0, 25, 50, 75, 100])
        for i, m in enumerate(ms):
            ax.text(100 * m.exact_match + 1.5, i, pct(m.exact_match), va="center", fontsize=8)
        ax.set_xlabel("exact match: tokens whose log-probs are bitwise equal (%)")
        ax.set_title(f"{title}: {ms[0].tokens} tokens", fontsize=10, loc="left")
        ax.tick_params(axis="y", labelsize=9)
        ax = axes[row][1]
        kl = [m.k3_kl for m in ms]
        ax.set_xscale("log")
        ax.set_xlim(floor, top)
        ax.barh(names, [max(v - floor, 0.0) for v in kl], left=floor, color="tab:orange")
        for i, m in enumerate(ms):
            v = m.k3_kl
            label = f"{v:.1e}" if v > 0 else ("0 (bit-exact)" if m.exact_match == 1.0 else "0")
            ax.text(v * 1.3 if v > 0 else floor * 1.3, i, label, va="center", fontsize=8)
        ax.set_xlabel("k3 KL(engine || trainer), mean per token (log scale)")
        ax.set_yticklabels([])
    e = rep.engine
    model = getattr(rep, "model", {}) or {}
    size = ", ".join(f"{k.replace('num_', '').replace('_', ' ')} {v}" for k, v in model.items()
                     if k != "rope_parameters")
    rope = model.get("rope_parameters")
    if isinstance(rope, dict):  # a scaled RoPE: its type and factor (the rest is in the JSON)
        size += f"{', ' if size else ''}RoPE {rope.get('rope_type')}" + (
            f" x{rope['factor']:g}" if isinstance(rope.get("factor"), (int, float)) else "")
    fig.suptitle(f"{e['name']} {e['version']} (mode {e.get('mode', 'default')}) vs HF trainer, family {rep.family}"
                 + (f"\n{size}" if size else ""), fontsize=11)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=120, format="png")
    plt.close(fig)
    return buf.getvalue()


def in_situ_table(fit, narrow: bool = False) -> Table:
    """Bitwise match per captured tensor: the op-level start, the fitted profile, and for each
    region the best candidate with other rounding sites there (the runner-up; ``narrow``: none, for
    an 80-column terminal: they are in the profile's evidence)."""
    from engineprofiles.regions import REGIONS

    runners = []
    for region, results in fit.candidates.items():
        spec = REGIONS[region]
        win = fit.points[region]
        others = [(r.total.matched, p, r) for p, r in results if spec.site_part(p) != spec.site_part(win)]
        if others:
            m, p, r = max(others, key=lambda x: x[0])
            runners.append((f"runner-up {region}", p, r))
    if narrow:
        runners = []
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
