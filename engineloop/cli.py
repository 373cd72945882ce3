"""probe-engine: the command line. Thin: it parses, calls the library, prints."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from engineprofiles import __version__, engines
from engineprofiles.errors import EngineProfilesError
from engineprofiles.names import FAMILY_NAMES
from engineprofiles.text import install as install_printable

# render and store (and through them torch) are imported inside the commands that use them, so
# that `probe-engine vllm` starts and hands over to the engine's environment without loading torch
# in this process first (~2 s of a warm probe on a 2-core CPU, import and teardown together).

app = typer.Typer(
    help="Measure where an inference engine rounds to BF16/FP16 (RoPE, SwiGLU, residual RMSNorm), "
    "and read, check and compare the resulting profiles.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # plain text: a docstring's paragraphs are re-flowed to the terminal's width (rich mode keeps their line
    # breaks, which an 80-column terminal then wraps again mid-line), and brackets are printed as written
    rich_markup_mode=None,
)
# Every string these consoles print goes through engineprofiles.text.printable: a profile's or a
# capture's strings (and error messages quoting them) never drive the terminal.
out = install_printable(Console())
err = install_printable(Console(stderr=True))


def _fail(e: Exception, code: int = 2) -> None:
    # Messages quote paths and profile fields: printed as text, never parsed as rich markup.
    err.print(Text.assemble(("error:", "red"), " ", str(e)), highlight=False)
    raise typer.Exit(code)


def _print_fitted(console: Console, wide, narrow=None) -> None:
    """Print a table (or group): piped or redirected, as wide as it needs (print(width=) only narrows),
    so that no name or number is cut; in a terminal narrower than that, ``narrow`` (fewer columns)
    where there is one, never every column cut to "…"."""
    from rich.console import Group
    from rich.measure import Measurement

    # the tables' width: text around them (a head, warnings) wraps and does not widen the output
    parts = [r for r in (wide.renderables if isinstance(wide, Group) else [wide]) if isinstance(r, (Table, Group))]
    natural = max((Measurement.get(console, console.options.update(max_width=10_000), r).maximum for r in parts),
                  default=console.width)
    if not console.is_terminal:
        install_printable(Console(file=console.file, width=max(console.width, natural))).print(wide)
    elif natural > console.width and narrow is not None:
        console.print(narrow)
    else:
        console.print(wide)


def _say(console: Console, text: str, style: str = "") -> None:
    """Print ``text`` literally (it may hold paths or profile strings), in ``style``."""
    console.print(Text(text, style=style), highlight=False)


def _prefixed(label: str, style: str, text: str) -> Text:
    return Text.assemble((label, style), " ", text)


@app.command()
def validate(profiles: list[str] = typer.Argument(..., help="profile files or shipped names")) -> None:
    """Check profiles against the schema; exit 1 if any is invalid."""
    from engineprofiles import store

    bad = 0
    for name in profiles:
        try:
            p = store.get_profile(name)
        except EngineProfilesError as e:
            err.print(_prefixed("invalid", "red", str(e)), highlight=False)
            bad += 1
            continue
        out.print(_prefixed("ok", "green", f"{name}: {p.engine.name} {p.engine.version} {p.engine.backend} {p.dtype}"),
                  highlight=False)
    if bad:
        raise typer.Exit(1)


@app.command()
def show(
    profile: str = typer.Argument(..., help="a profile file, shipped name or engine (vllm, vllm==0.32.0:eager)"),
    as_json: bool = typer.Option(False, "--json", help="print the profile as one JSON object instead of the tables"),
) -> None:
    """Print a profile's rounding sites per region, with the evidence behind them.

    `--json`: {"name": the profile's canonical name, "requested": the argument, "path": its file (null for
    a profile chosen by engine name among several), "profile": the profile as loaded, as its YAML would be
    written now (a file of an older schema version is migrated)}."""
    import json

    import yaml

    from engineprofiles import render, store

    try:
        p = store.get_profile(profile)
        path = None if store.names_engine(profile) else str(store.resolve(profile))
    except EngineProfilesError as e:
        _fail(e)
    if as_json:
        typer.echo(json.dumps({"name": p.canonical_name, "requested": profile, "path": path,
                               "profile": yaml.safe_load(p.to_yaml())}, indent=2))
        return
    name = f"{profile}: {p.canonical_name}" if store.names_engine(profile) else profile
    if out.is_terminal:
        render.show(p, out, name=name)
        return
    _print_fitted(out, render.show_group(p, name, wide=True))  # piped: no name, site or runner-up cut


@app.command()
def plot(
    result: str = typer.Argument(..., help="a mismatch result: the JSON of `probe-engine mismatch ... --json FILE`"),
    output: str = typer.Option(..., "--output", "-o", help="the PNG to write (a regular file or a new path; not the "
                               "result itself, nor in the folder of shipped profiles); '-' writes the PNG's bytes to "
                               "stdout (redirected or piped, not a terminal)"),
) -> None:
    """Draw a saved mismatch result as a PNG: sampled tokens and the prefill re-scoring, exact-match
    fraction and k3 KL per trainer row (needs matplotlib: the package's plot extra)."""
    from . import runner, tables

    try:
        tables.check_plot_available("probe-engine plot")
        runner.check_outputs([("-o", output)], [("the mismatch result", result)])
        _check_binary_stdout(output, "-o", "the PNG")
        rep = tables.load_mismatch(result)
        where = runner.write_output(output, tables.mismatch_png(rep))
    except EngineProfilesError as e:
        _fail(e)
    if tables.rows_left_out(rep):
        _say(err, f"note: the PNG draws the first {tables.MAX_PLOT_ROWS} rows of each panel (the result has "
                  f"{len(rep.rows)} sampled and {len(rep.prefill_rows)} prefill rows)")
    _say(err, f"wrote {where if where != 'stdout' else 'the PNG to stdout'}")


def _check_binary_stdout(path: Optional[str], option: str, what: str) -> None:
    """``-`` for a binary output: refused where stdout is a terminal (the bytes would be shown as text)."""
    import sys

    if path == "-" and sys.stdout.isatty():
        raise EngineProfilesError(f"{option} - writes {what}'s bytes to stdout, which is a terminal: redirect it "
                                  "(> file.png), pipe it, or give a file")


@app.command("list")
def list_profiles(
    as_json: bool = typer.Option(False, "--json", help="print a JSON list (one object per profile) instead of the table"),
) -> None:
    """List the shipped profiles (engine, version, backend, mode, dtype, CPU capability, method).

    `--json`: a JSON list of objects with name, path, engine, version, mode, dtype, device (cpu,
    cuda), device_name, capability, method, schema and date; an invalid file is {name, path, error}."""
    import json

    from engineprofiles import store
    from engineprofiles.select import Candidate

    d = store.shipped_dir()
    names = store.shipped_names()
    rows: list[dict] = []
    for n in names:
        path = str(d / f"{n}.yaml")
        try:
            p = store.get_profile(path)
        except EngineProfilesError as e:
            rows.append({"name": n, "path": path, "error": str(e)})
            continue
        rows.append({**Candidate.of(n, p).as_dict(), "path": path})
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    if not names:
        _say(out, f"no shipped profiles in {d}")
        return
    t = Table(title=Text(f"shipped profiles ({d})"))
    # The names are what `show`, `diff` and apply_profile take: never cut or folded (the other
    # columns wrap first in a narrow terminal; piped, the table is printed at its natural width).
    t.add_column("name", no_wrap=True, min_width=max(len(n) for n in names))
    for col in ("engine", "version", "backend", "mode", "dtype", "capability", "method", "date"):
        t.add_column(col, overflow="fold")
    for r in rows:
        if "error" in r:
            t.add_row(Text(r["name"]), Text(f"invalid: {r['error']}", style="red"), *[""] * 7)
            continue
        t.add_row(*(Text(str(v)) for v in (r["name"], r["engine"], r["version"], r["device"], r["mode"], r["dtype"],
                                           r["capability"] or "-", r["method"], r["date"][:10])))
    _print_fitted(out, t)


@app.command()
def diff(
    a: str = typer.Argument(..., help="first profile (file or shipped name)"),
    b: str = typer.Argument(..., help="second profile (file or shipped name)"),
    format: str = typer.Option("table", "--format", "-f", help="table, markdown or json"),
) -> None:
    """Compare two profiles site by site. Exit 0 when all sites agree, 1 when any differs, 2 on error.

    Formula variants, evidence and provenance differences are shown but do not count as site
    differences."""
    from engineprofiles import render, store
    from engineprofiles.diff import diff_profiles

    if format not in ("table", "markdown", "json"):
        _fail(EngineProfilesError(f"--format must be table, markdown or json; got {format!r}"))
    try:
        pa, pb = store.get_profile(a), store.get_profile(b)
    except EngineProfilesError as e:
        _fail(e)
    d = diff_profiles(pa, pb, a, b)
    if format == "json":
        typer.echo(d.to_json())  # the JSON's own escapes, as written
    elif format == "markdown":
        out.print(d.to_markdown(), highlight=False, markup=False, soft_wrap=True)
    else:
        out.print(render.diff_table(d))
    raise typer.Exit(d.exit_code)


@app.command()
def check(
    profiles: list[str] = typer.Argument(..., help="profiles to check: files, shipped names or ENGINE[==VERSION][:MODE]"),
    env: Optional[str] = typer.Option(
        None, help="engine environment (venv folder, python or version); default: the profile's version's, else the newest"),
    format: str = typer.Option("table", "--format", "-f", help="table, markdown or json"),
) -> None:
    """Re-probe the installed engine a profile was measured on; exit 0 when it still rounds
    where the profile says, 1 when it does not, 2 on bad input.

    The profile names what to probe: the engine and its version, the execution mode, dtype and
    device, the probe's seed and sweep, and the regions it measured (op-level, as `probe-engine
    ENGINE --op-level` probes). Every region's lattice point (its sites and formula variants) and
    attention's must equal the profile's; match rates, settings and provenance are shown but decide
    nothing. Several profiles of one engine version are checked in one run, each probe setting
    probed once.

    Exit 0: every point agrees. Exit 1: a point differs (the diff is printed), or the installed
    engine is another version than the profile's (said so, nothing probed: that is another engine;
    check in its environment with --env, or probe it and use `diff`). Exit 2: bad input: an unknown
    or invalid profile, no environment with the engine, an in-situ profile (refused: its fit runs
    the whole engine for minutes; check the op-level profile it starts from, or re-fit with
    `probe-engine vllm --in-situ` and `diff`), a synthetic or patched-model profile, profiles of
    different engine versions; and a probe that crashed.

    The engine runs in its environment (scripts/engine_env.sh), by default the one of the
    profile's version, else the newest. On a CPU whose capability (vector ISA) differs from the
    profile's engine.settings.cpu_capability the profile's evidence belongs to another code path:
    the points are compared all the same, with a note."""
    import sys
    import time

    from engineprofiles import store

    from . import check as chk
    from . import runner

    if format not in ("table", "markdown", "json"):
        _fail(EngineProfilesError(f"--format must be table, markdown or json; got {format!r}"))
    try:
        loaded = chk.load_named(profiles, lambda m: _say(err, m))
        plans = [(n, chk.plan_for(p, n)) for n, _, p in loaded]
        engine, version = chk.one_engine(plans)
        _check_in_engine_env(engine, version, env, [n for n, _, _ in loaded], format)
        for _, plan in plans:
            _check_cuda(plan.device)
    except EngineProfilesError as e:
        _fail(e)
    t0 = time.perf_counter()
    installed = store.installed_version(engine)
    try:
        outcomes = chk.run_checks(loaded, plans, engine, version, installed, f"in {sys.executable}",
                                  lambda m: _say(err, f"  [{time.perf_counter() - t0:6.1f}s] {m}"),
                                  lambda m: _say(err, m, "bold"))
    except EngineProfilesError as e:
        _fail(e)
    except Exception as e:  # a crash is exit 2, never 1 (which says the engine rounds differently)
        import traceback

        traceback.print_exc()
        _fail(EngineProfilesError(f"the probe failed ({type(e).__name__}: {e}); that is an error, not a rounding "
                                  "difference"))
    _report_check(outcomes, engine, version, installed, format)
    global _probe_done
    _probe_done = True
    raise typer.Exit(max(o.exit_code for o in outcomes))


def _check_in_engine_env(engine: str, version: str, env: Optional[str], names: list[str], format: str) -> None:
    """Run ``check`` again in the engine's environment where this process cannot probe the profiles'
    engine (``--env`` given, the engine not importable here, or another version here while its own
    environment exists): exits with that run's code. Raises where no environment has the engine."""
    import sys

    from engineprofiles import store

    from . import check as chk
    from . import runner

    importable = runner.engine_importable(engine)
    here = store.installed_version(engine) if importable else None
    other_here = here is not None and chk.public_version(here) != chk.public_version(version)
    if (env or not importable or (other_here and runner.environment_of(engine, version))) \
            and not os.environ.get("ENGINEPROFILES_REEXEC"):
        if env:
            python = runner.find_engine_python(engine, env)
        else:
            python = runner.environment_of(engine, version)
            if python is None:
                python = runner.find_engine_python(engine)
                _say(err, f"note: no {engine}-{version} environment in {runner.ENGINES_DIR}; trying "
                          f"{python.parent.parent.name}")
        argv = ["check", *names, "--format", format]
        raise typer.Exit(runner.reexec_in(python, argv, lambda m: _say(err, m), codes=(0, 1, 2)))
    if not runner.engine_importable(engine):
        raise runner.EngineNotInstalled(
            f"{engine} is not importable in {sys.executable}; make its environment with "
            f"`{runner.install_hint(engine)}`")


def _report_check(outcomes: list, engine: str, version: str, installed: Optional[str], format: str) -> None:
    import json

    from engineprofiles import render

    code = max(o.exit_code for o in outcomes)
    if format == "json":
        typer.echo(json.dumps({"engine": engine, "version": version, "installed_version": installed,
                               "exit_code": code, "profiles": [o.as_dict() for o in outcomes]}, indent=2))
        return
    for o in outcomes:
        for n in o.notes:
            _say(err, f"note: {o.name}: {n}", "yellow")
        if format == "markdown":
            if o.diff is not None:
                out.print(o.diff.to_markdown(), highlight=False, markup=False, soft_wrap=True)
            out.print(o.verdict() + "\n", highlight=False, markup=False, soft_wrap=True)
            continue
        if o.diff is not None:
            out.print(render.diff_table(o.diff, summary=False))
        _say(out, o.verdict(), "green" if o.exit_code == 0 else "red bold")


FAMILY_HELP = f"tiny model family: {', '.join(FAMILY_NAMES)} (default qwen2; with --model: the checkpoint's)"
MODEL_HELP = ("a local Hugging Face checkpoint folder (config.json and weights of a supported family's causal LM) to run "
              "instead of the tiny model: the engine loads it where it is, the trainer in BF16; prompts of random token "
              "ids from its vocabulary (--prompts, --prompt-len, --seed); the tiny model's size options do not apply")


@app.command()
def mismatch(
    engine: str = typer.Argument("vllm", help=f"engine that samples: {' or '.join(engines.loop_engines())}"),
    family: Optional[str] = typer.Option(None, help=FAMILY_HELP),
    model: Optional[str] = typer.Option(None, "--model", help=MODEL_HELP),
    profile: Optional[str] = typer.Option(None, help="profile to apply (default: the shipped one of the engine)"),
    prompts: int = typer.Option(4, help="number of prompts"),
    max_tokens: int = typer.Option(16, help="tokens sampled per prompt"),
    seed: int = typer.Option(0, help="seed of the model weights, prompts and sampling"),
    env: Optional[str] = typer.Option(None, help="engine environment (venv, python or version)"),
    json_out: Optional[str] = typer.Option(None, "--json", help="also write the numbers as JSON to this file; '-': "
                                           "to stdout (the table then goes to stderr)"),
    plot: Optional[str] = typer.Option(None, help="also draw the result as a PNG, as `probe-engine plot` draws a "
                                       "saved one (needs matplotlib: the plot extra); '-': its bytes to stdout (not a "
                                       "terminal; the table then goes to stderr)"),
    capture: Optional[str] = typer.Option(None, help="reuse a capture file instead of running the engine"),
    save_capture: Optional[str] = typer.Option(None, help="keep the engine's capture in this file (for --capture)"),
    mode: str = typer.Option("default", help="the engine's execution mode: default (vLLM on CPU: compiled) or eager"),
    exact: bool = typer.Option(False, "--exact", help="add the 'exact' rows: the trainer in exact mode "
                               "(apply_profile(..., exact=True): the profile's attention too), re-scoring in one "
                               "prefill; and the sampled row 'exact, decoded': the completion decoded token by token "
                               "with a KV cache, as the engine sampled it"),
    prompt_len: int = typer.Option(12, help="length of the first prompt (the others add 1..4 tokens)"),
    layers: Optional[int] = typer.Option(None, help="tiny model size: decoder layers (default 2)"),
    hidden: Optional[int] = typer.Option(None, help="tiny model size: hidden size (default 256)"),
    intermediate: Optional[int] = typer.Option(None, help="tiny model size: MLP width (default 512; SGLang wants multiples of 32)"),
    heads: Optional[int] = typer.Option(None, help="tiny model size: attention heads (default 4)"),
    kv_heads: Optional[int] = typer.Option(None, help="tiny model size: key/value heads (default 2)"),
    head_dim: Optional[int] = typer.Option(None, help="tiny model size: head dim (default 64)"),
    batch_check: bool = typer.Option(False, "--batch-check", help="also re-score the same sequences in other batch "
                                     "compositions inside the engine (alone again, all together, reversed, beside a "
                                     "longer sequence; the prompts decoded greedily alone and together, and for vLLM together with staggered "
                                     "lengths) and report whether its log-probs change with the batch (the engine then "
                                     "runs several sequences at once); with --exact, also exact mode against the batched "
                                     "decode runs, each sequence as sampled alone and as sampled together"),
    rope_scaling: Optional[str] = typer.Option(
        None, help="tiny model's RoPE scaling (its rope_parameters; default: none): llama3 (Llama 3.1's: factor 8, "
        "low/high frequency factors 1/4, original context 8192), linear (factor 3), yarn (factor 4 over an original context of 10240) or dynamic (factor 2)"),
    allow_other_machine: bool = typer.Option(
        False, "--allow-other-machine", help="with --exact: compute the exact rows although the profile was probed on "
        "another machine than the engine's or this one (refused otherwise: the engine's kernels follow the CPU; the "
        "rows then carry a warning and are no claim)"),
    kernels: str = typer.Option("auto", "--kernels", help="with --exact: exact mode's attention: engine (the engine's "
                                "own kernel: run probe-engine with the engine environment's python; refused otherwise), "
                                "portable (the reference the probe fits), auto (the engine's kernel where it loads and "
                                "is the one the profile records, else the reference)"),
) -> None:
    """Sample with the real engine on a tiny local model (or --model, your own checkpoint), recompute the
    log-probs in the HF trainer as-is, with the profile, with each region alone and (--exact) in exact mode
    (re-scored in one prefill, and the sampled tokens also decoded one at a time as the engine did); print
    the mismatch metrics (exact-match fraction first). --batch-check adds whether the engine's own log-probs
    are batch-invariant (with --exact, also exact mode against its batched decode runs)."""
    import shlex, sys, time  # noqa: E401

    from . import tables

    size = _size(layers, hidden, intermediate, heads, kv_heads, head_dim)
    try:  # everything that can be checked is checked before the engine runs (minutes)
        family = _loop_family(family, model, size, rope_scaling)
        _check_mismatch_options(engine, family, size, capture=capture, save_capture=save_capture, prompts=prompts,
                                max_tokens=max_tokens, prompt_len=prompt_len, mode=mode, json_out=json_out, plot=plot,
                                profile=profile, seed=seed, rope_scaling=rope_scaling, exact=exact,
                                allow_other_machine=allow_other_machine, kernels=kernels)
    except EngineProfilesError as e:
        _fail(e)
    from .mismatch import run_mismatch

    t0 = time.perf_counter()
    try:
        rep = run_mismatch(engine, family=family, profile=profile, prompts=prompts, max_tokens=max_tokens, seed=seed,
                           env=env, capture_file=capture, mode=mode, exact=exact, size=size, prompt_len=prompt_len,
                           save_capture=save_capture, batch_check=batch_check, rope_scaling=rope_scaling,
                           allow_other_machine=allow_other_machine, kernels=kernels, model_path=model,
                           note=lambda m: _say(err, f"  [{time.perf_counter() - t0:6.1f}s] {m}"))
    except EngineProfilesError as e:
        _fail(e)
    rep.command = os.environ.get("ENGINEPROFILES_COMMAND") or shlex.join(["probe-engine", *sys.argv[1:]])
    _print_fitted(err if "-" in (json_out, plot) else out,  # stdout: the JSON or PNG alone
                  tables.mismatch_table(rep), tables.mismatch_table(rep, narrow=True))
    _write_outputs(rep, json_out, plot)


def _check_mismatch_options(engine: str, family: str, size: dict[str, int], *, capture, save_capture, prompts: int,
                            max_tokens: int, prompt_len: int, mode: str, json_out, plot, profile, seed: int,
                            rope_scaling, exact: bool, allow_other_machine: bool, kernels: str = "auto") -> None:
    """``probe-engine mismatch``'s options, checked before the engine runs: EngineProfilesError for the first
    that is wrong (exact mode's machine check included, where no capture is given)."""
    from engineprofiles.extras import require

    from . import tables

    loop = engines.loop_engines()
    if engine not in loop:
        raise EngineProfilesError(f"mismatch runs {' or '.join(loop)}; got {engine!r}")
    record = engines.get(engine)
    if mode not in record.loop_modes:
        raise EngineProfilesError(f"mismatch runs {record.title} in its {' or '.join(record.loop_modes)} mode only; got "
                                  f"--mode {mode!r}")
    _check_loop_options(family, size, capture, save_capture, prompts, max_tokens, prompt_len, mode, json_out,
                        plot=plot, profile=profile, seed=seed, rope_scaling=rope_scaling)
    if plot:
        _check_binary_stdout(plot, "--plot", "the PNG")
        tables.check_plot_available()
    require("insitu", "probe-engine mismatch (the trainer side: HF models patched by the emulator)")
    if allow_other_machine and not exact:
        raise EngineProfilesError("--allow-other-machine concerns the exact rows: pass it with --exact")
    from .mismatch import check_kernels_option

    check_kernels_option(kernels, exact, record, "probe-engine", "-m engineloop.cli mismatch ...")
    prof = _check_profile_option(profile, engine, exact=exact, capture=capture)
    if exact and prof is not None and capture is None:  # the trainer's machine, before the engine runs
        from .mismatch import check_machine

        check_machine(None, prof, allow_other_machine)
    if exact and prof is not None:  # an attention point short of bitwise: refused now, not after the engine ran
        from emulator.patching.apply import check_attention_evidence

        check_attention_evidence(prof)
        _check_blocks_entries(prof, family)


def _check_blocks_entries(prof, family: str) -> None:
    """A family with sparse MoE blocks needs the profile's moe entry (and shared_expert where it has one):
    without it the exact rows would be refused after the engine ran, so the run is refused now."""
    from engineprofiles.families import FAMILIES

    fam = FAMILIES.get(family)
    need = [] if fam is None else [e for e, on in (("moe", fam.moe), ("shared_expert", fam.shared_expert)) if on]
    for entry in need:
        if not prof.available(entry):
            raise EngineProfilesError(
                f"--exact: profile {prof.canonical_name} has no measured {entry} entry "
                f"({prof.entry(entry).evidence.reason}), and the {family} model has sparse MoE blocks that exact "
                f"mode computes at that point: refused before the engine runs; use a profile in which {entry} was "
                "measured")


def _write_outputs(rep, json_out, plot) -> None:
    """The mismatch report's --json and --plot outputs (a file, or '-': stdout)."""
    import json

    from . import runner, tables

    try:
        if json_out:
            where = runner.write_output(json_out, json.dumps(rep.as_dict(), indent=2))
            _say(err, f"wrote {where if where != 'stdout' else 'the JSON to stdout'}")
        if plot:
            where = runner.write_output(plot, tables.mismatch_png(rep))
            _say(err, f"wrote {where if where != 'stdout' else 'the PNG to stdout'}")
    except EngineProfilesError as e:
        _fail(e)



def _size(layers, hidden, intermediate, heads, kv_heads, head_dim) -> dict[str, int]:
    return {k: v for k, v in (("num_hidden_layers", layers), ("hidden_size", hidden),
                              ("intermediate_size", intermediate), ("num_attention_heads", heads),
                              ("num_key_value_heads", kv_heads), ("head_dim", head_dim)) if v is not None}


def _loop_family(family: Optional[str], model: Optional[str], size: dict[str, int], rope_scaling) -> str:
    """The family of an engine-in-the-loop run: the checkpoint's with --model (checked: a checkpoint folder of a
    supported family; the tiny model's options refused), else --family or qwen2."""
    from .checkpoint import resolve_family

    if model is not None and (size or rope_scaling):
        given = [f"--{k}" for k, v in (("layers/--hidden/... (model size)", size), ("rope-scaling", rope_scaling)) if v]
        raise EngineProfilesError(f"--model runs the checkpoint as it is: {' and '.join(given)} apply to the tiny "
                                  "model only; leave them out")
    return resolve_family(family, model)


def _check_loop_options(family, size, capture, save_capture, prompts, max_tokens, prompt_len, mode, json_out,
                        plot=None, profile=None, seed=0, rope_scaling=None) -> None:
    """The options of the engine-in-the-loop commands that need no engine: checked before it starts; the
    outputs together (runner.check_outputs): none of them the capture or profile file read, two outputs never
    one file, '-' (stdout) for one of them at most."""
    from engineprofiles.names import check_family_name, check_mode_name

    from . import runner

    check_family_name(family)
    if rope_scaling is not None:
        from engineprofiles.names import check_rope_scaling_name

        check_rope_scaling_name(rope_scaling)
    for k, v in size.items():
        if v < 1:
            raise EngineProfilesError(f"{k} must be a positive integer; got {v}")
    if capture and save_capture:
        raise EngineProfilesError("--save-capture keeps a new capture; with --capture there is none to keep")
    if prompt_len < 1 or prompts < 1 or max_tokens < 1:
        raise EngineProfilesError("--prompts, --max-tokens and --prompt-len must be positive")
    _check_seed(seed)
    check_mode_name(None, mode)
    if save_capture == "-":
        raise EngineProfilesError("--save-capture takes a file (a capture is kept for --capture), not '-'")
    runner.check_outputs([("--json", json_out), ("--plot", plot), ("--save-capture", save_capture)],
                         [("the --capture file", capture), ("the --profile file", _profile_file(profile))])


SEED_MAX = 2**31 - 1  # what every seed the tools pass on takes (the engines' samplers, numpy's legacy seed: < 2**32)


def _check_seed(seed: int) -> None:
    if not 0 <= seed <= SEED_MAX:
        shown = str(seed) if len(str(seed)) <= 40 else f"{str(seed)[:20]}... ({len(str(seed))} digits)"
        raise EngineProfilesError(f"--seed must be an integer from 0 to {SEED_MAX}; got {shown}")


def _check_profile_option(profile: Optional[str], engine: str, *, exact: bool, capture: Optional[str]):
    """--profile of mismatch and localize, resolved and loaded before any engine or trainer work (a
    spec such as ``vllm==`` that names no engine and no file, a missing or invalid file, an engine with
    no fitting shipped profile: refused now, not after the engine ran for minutes); with exact mode and
    no capture, a profile of the other engine the loop runs is refused (exact mode reproduces the engine
    whose profile it applies; with a capture, engine_profile checks it against the capture's engine
    before any trainer row). The Profile, or None without --profile."""
    if profile is None:
        return None
    import warnings

    from engineprofiles.store import get_profile

    with warnings.catch_warnings():  # the run chooses the same profile again, and warns then
        warnings.simplefilter("ignore")
        prof = get_profile(profile)
    if exact and capture is None and prof.engine.name != engine and prof.engine.name in engines.loop_engines():
        raise EngineProfilesError(
            f"--exact: --profile {profile} is a profile of {prof.engine.name} ({prof.canonical_name}), but the engine "
            f"that samples is {engine}: exact mode reproduces the engine its profile describes; pass a {engine} "
            "profile")
    return prof


@app.command()
def localize(
    engine: str = typer.Argument("vllm", help=f"engine to compare with: {', '.join(engines.localize_engines())}"),
    family: Optional[str] = typer.Option(None, help=FAMILY_HELP),
    model: Optional[str] = typer.Option(None, "--model", help=MODEL_HELP),
    trainer: list[str] = typer.Option(["as-is", "profile"], help="trainer(s) to localize: as-is (unpatched), profile "
                                      "(the engine's profile applied), exact (exact=True); repeat the option for several"),
    profile: Optional[str] = typer.Option(None, help="the engine's profile (default: its shipped one for the capture's "
                                          "version and mode)"),
    mode: str = typer.Option("default", help="the engine's execution mode: default (vLLM on CPU: compiled; only q/k/v, "
                             "attention output, final hidden states and log-probs observable) or eager (every tensor)"),
    prompts: int = typer.Option(2, help="number of prompts"),
    max_tokens: int = typer.Option(8, help="tokens sampled per prompt"),
    prompt_len: int = typer.Option(12, help="length of the first prompt (the others add 1..4 tokens)"),
    seed: int = typer.Option(0, help="seed of the model weights, prompts and sampling"),
    env: Optional[str] = typer.Option(None, help="engine environment (venv, python or version)"),
    capture: Optional[str] = typer.Option(None, help="reuse a capture file instead of running the engine"),
    save_capture: Optional[str] = typer.Option(None, help="keep the engine's capture in this file (for --capture)"),
    json_out: Optional[str] = typer.Option(None, "--json", help="also write the result as JSON to this file; '-': "
                                           "to stdout (the table then goes to stderr)"),
    no_fixes: bool = typer.Option(False, "--no-fixes", help="only localize; do not try the profile changes"),
    layers: Optional[int] = typer.Option(None, help="tiny model size: decoder layers (default 2)"),
    hidden: Optional[int] = typer.Option(None, help="tiny model size: hidden size (default 256)"),
    intermediate: Optional[int] = typer.Option(None, help="tiny model size: MLP width (default 512)"),
    heads: Optional[int] = typer.Option(None, help="tiny model size: attention heads (default 4)"),
    kv_heads: Optional[int] = typer.Option(None, help="tiny model size: key/value heads (default 2)"),
    head_dim: Optional[int] = typer.Option(None, help="tiny model size: head dim (default 64)"),
    rope_scaling: Optional[str] = typer.Option(
        None, help="tiny model's RoPE scaling (default: none): llama3, linear, yarn or dynamic, as for mismatch"),
) -> None:
    """Run the engine and the trainer on the same tiny model (or --model, your own checkpoint) and
    name the first tensor whose bits differ (residual stream, norm outputs, q/k/v, attention output, MLP output, final norm,
    log-probs), the match rate at each, and which profile change (a lattice neighbour of a region,
    or exact mode) would remove it. Exit 0 when it ran, whatever it found; 2 on bad input."""
    import json
    import shlex
    import sys
    import time

    from engineprofiles.extras import require

    from . import tables

    if engine not in engines.localize_engines():
        _fail(EngineProfilesError(f"localize runs {' or '.join(engines.localize_engines())} only (SGLang's capture runs "
                                  f"its model compiled into the scheduler process, with no per-module tensors yet); "
                                  f"got {engine!r}"))
    size = _size(layers, hidden, intermediate, heads, kv_heads, head_dim)
    try:
        family = _loop_family(family, model, size, rope_scaling)
        _check_loop_options(family, size, capture, save_capture, prompts, max_tokens, prompt_len, mode, json_out,
                            profile=profile, seed=seed, rope_scaling=rope_scaling)
        from .localize import TRAINERS

        bad = [t for t in trainer if t not in TRAINERS]
        if bad:
            raise EngineProfilesError(f"--trainer must be one of {', '.join(TRAINERS)}; got {', '.join(bad)}")
        require("insitu", "probe-engine localize (the trainer side: HF models patched by the emulator)")
        _check_profile_option(profile, engine, exact="exact" in trainer, capture=capture)
    except EngineProfilesError as e:
        _fail(e)
    from .localize import run_localize

    t0 = time.perf_counter()
    try:
        rep = run_localize(engine, family=family, trainers=tuple(dict.fromkeys(trainer)), profile=profile,
                           prompts=prompts, max_tokens=max_tokens, seed=seed, env=env, capture_file=capture,
                           save_capture=save_capture, mode=mode, size=size, prompt_len=prompt_len,
                           try_fixes=not no_fixes, rope_scaling=rope_scaling, model_path=model, note=lambda m: _say(err, f"  [{time.perf_counter() - t0:6.1f}s] {m}"))
    except EngineProfilesError as e:
        _fail(e)
    rep.command = os.environ.get("ENGINEPROFILES_COMMAND") or shlex.join(["probe-engine", *sys.argv[1:]])
    _print_fitted(err if json_out == "-" else out, tables.localize_table(rep))  # stdout: the JSON alone
    if json_out:
        from . import runner

        try:
            where = runner.write_output(json_out, json.dumps(rep.as_dict(), indent=2))
        except EngineProfilesError as e:
            _fail(e)
        _say(err, f"wrote {where if where != 'stdout' else 'the JSON to stdout'}")


OUTPUT_HELP = ("file, or folder for <canonical name>.yaml (a regular file or a new path; never a device or FIFO); "
               "'-' prints the YAML to stdout and the summary to stderr")
SHIP_HELP = "allow writing into the folder of shipped profiles (profiles/), as scripts/probe.sh --ship does"


def _check_arguments(engine: str, device: str, dtype: str, mode: str, family: str,
                     region: Optional[list[str]]) -> None:
    """The checks that need no torch and no engine: run before handing over to an engine's environment."""
    from engineprofiles.names import (check_device_name, check_dtype_name, check_family_name, check_mode_name,
                                      check_probe_region_name)

    check_dtype_name(dtype)
    check_mode_name(engine, mode)
    check_device_name(device)
    check_family_name(family)
    for r in region or []:
        check_probe_region_name(r)


def _profile_file(profile: Optional[str]) -> Optional[str]:
    """The file a profile argument names (a path or a shipped name), for the output checks; None when
    it names none (an engine, or nothing there: that error comes later, with its own message)."""
    if not profile:
        return None
    from engineprofiles import store

    try:
        return None if store.names_engine(profile) else str(store.resolve(profile))
    except EngineProfilesError:
        return None


def _check_cuda(device: str) -> None:
    if device.startswith("cuda"):
        import sys

        import torch

        index = int(device.split(":")[1]) if ":" in device else 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise EngineProfilesError(
                f"--device {device}: torch {torch.__version__} in {sys.executable} sees "
                f"{torch.cuda.device_count() if torch.cuda.is_available() else 'no'} CUDA device(s); probe on a GPU "
                "machine with a CUDA build (docs/probing.md: Probing CUDA builds on a GPU machine), or use --device cpu"
            )


def _probe(engine: str, device: str, dtype: str, mode: str, output: Optional[str], seed: int, quick: bool,
           region: Optional[list[str]], env: Optional[str], print_yaml: bool, model: Optional[str] = None,
           apply: Optional[str] = None, ship: bool = False) -> None:
    import os
    import sys
    import time

    from . import runner

    try:
        _check_arguments(engine, device, dtype, mode, model or "qwen2", region)
        _check_seed(seed)
        target, is_dir = runner.output_path(output, ship, [("the --apply profile", _profile_file(apply))])
        if not runner.engine_importable(engine) and not os.environ.get("ENGINEPROFILES_REEXEC"):
            python = runner.find_engine_python(engine, env)
            raise typer.Exit(runner.reexec_in(python, sys.argv[1:], lambda m: _say(err, m)))
        from engineprofiles import rounding

        _check_cuda(device)
        dt = rounding.act_dtype(dtype)
        if not runner.engine_importable(engine):
            raise runner.EngineNotInstalled(
                f"{engine} is not importable in {sys.executable}; make its environment with "
                f"`{runner.install_hint(engine)}`"
            )
        from engineprofiles.probe.adapters import make_adapter
        from engineprofiles.probe.harness import run_probe

        t0 = time.perf_counter()
        err.print(f"[bold]probing {engine}[/bold] (mode {mode}, {dtype}, {device}, seed {seed})", highlight=False)
        adapter = _patched_adapter(model, apply, dt, device) if apply else make_adapter(engine, mode, dt, device, model)
        err.print(f"  {engine} loaded in {time.perf_counter() - t0:.1f}s", highlight=False)

        def progress(msg: str) -> None:
            _say(err, f"  [{time.perf_counter() - t0:6.1f}s] {msg}")

        load_s = time.perf_counter() - t0
        profile, results = run_probe(adapter, dtype=dtype, device=device, seed=seed, quick=quick, regions=region,
                                     progress=progress)
        timings = {"load": round(load_s, 2), **{n: round(r.seconds, 2) for n, r in results.items()},
                   "total": round(time.perf_counter() - t0, 2)}
        err.print("timings (s): " + ", ".join(f"{k} {v}" for k, v in timings.items()), highlight=False)
        _write_timings(timings)
    except EngineProfilesError as e:
        _fail(e)
    _emit(profile, output, target, is_dir, print_yaml)
    global _probe_done
    _probe_done = True


def _emit(profile, output: Optional[str], target: Optional[Path], is_dir: bool, print_yaml: bool,
          extra=None, extra_narrow=None) -> None:
    """Print the summary (to stderr with -o -, so that stdout is the YAML alone), the YAML when
    asked or with -o -, and write the file."""
    from engineprofiles import render

    from . import runner

    summary = err if output == "-" else out
    summary.print(render.summary_group(profile))  # the whole profile: the file, or probe-engine show FILE
    if extra is not None:
        _print_fitted(summary, extra, extra_narrow)
    if print_yaml or target is None:
        out.print(profile.to_yaml(), highlight=False, markup=False, soft_wrap=True)
    if target is not None:
        try:
            path = runner.write_profile(profile, target, is_dir)
        except EngineProfilesError as e:
            _fail(e)
        err.print(_prefixed("wrote", "green", f"{path} (all of it: probe-engine show {path})"), highlight=False)


# Set when an op-level probe has written everything; read by _main_exit_fast.
_probe_done = False


def _write_timings(timings: dict[str, float]) -> None:
    """The phases' seconds, to the JSON file $ENGINEPROFILES_TIMINGS names (scripts/bench_probe.py)."""
    if os.environ.get("ENGINEPROFILES_TIMINGS"):
        import json

        with open(os.environ["ENGINEPROFILES_TIMINGS"], "w") as f:
            json.dump({k: round(v, 2) for k, v in timings.items()}, f)


def _patched_adapter(family: Optional[str], profile: str, dt, device: str):
    """The transformers adapter on a tiny ``family`` model patched with ``profile`` (the closed
    loop: probing it should give back the profile's sites). emulator is imported only here."""
    from emulator import apply_profile
    from engineprofiles import store
    from engineprofiles.models import tiny_model
    from engineprofiles.probe.adapters.transformers import TransformersAdapter

    prof = store.get_profile(profile)
    model = tiny_model(family or "qwen2", dtype=dt, device=device)
    apply_profile(model, prof)
    return TransformersAdapter(dtype=dt, device=device, model=model, label=prof.canonical_name)


def _in_situ(engine: str, families: list[str], output: Optional[str], seed: int, env: Optional[str],
             captures: list[str], prompts: int, print_yaml: bool, mode: str = "default", dtype: str = "bfloat16",
             device: str = "cpu", ship: bool = False, rope_scaling: Optional[str] = None,
             self_check: bool = True) -> None:
    """Run the engine on a tiny model of each family (or take the captures given, one per family,
    in order) and fit one profile to all of them; then (``self_check``, where the engine ran) check
    exact mode with it on a model of random widths (engineloop.selfcheck). ``rope_scaling``: the tiny models' RoPE scaling
    (engineprofiles.models.ROPE_SCALINGS; None: default RoPE), checked against the captures'."""
    import sys
    import time

    from engineprofiles.extras import require

    try:
        require("insitu", "the in-situ fit (HF models patched by the emulator)")
    except EngineProfilesError as e:
        _fail(e)
    from . import runner, tables
    from .fit import fit_attention_in_situ, fit_profiles, in_situ_pairs, in_situ_profile, in_situ_start

    t0 = time.perf_counter()

    def note(m: str) -> None:
        _say(err, f"  [{time.perf_counter() - t0:6.1f}s] {m}")

    try:
        if dtype != "bfloat16" or device != "cpu":
            raise EngineProfilesError(
                f"--in-situ runs the engine's CPU build in bfloat16 only; got --dtype {dtype} --device {device}: "
                "use --op-level for other dtypes and devices"
            )
        target, is_dir = runner.output_path(output, ship, [("a --capture file", c) for c in captures])
        pairs = in_situ_pairs(engine, families, captures, seed=seed, prompts=prompts, mode=mode, env=env,
                              rope_scaling=rope_scaling, note=note)
        marks = {"capture": time.perf_counter() - t0}
        start = in_situ_start(engine, pairs[0][2])
        start_name = start.canonical_name
        n = sum(len(c["sequences"]) for _, _, c in pairs)
        note(f"fitting in situ from {start_name} ({n} sequences of {', '.join(families)})")
        fit = fit_profiles(pairs, start, note=note)
        marks["fit regions"] = time.perf_counter() - t0
        att_fit = fit_attention_in_situ([c for _, _, c in pairs], start, note=note)
        marks["fit attention"] = time.perf_counter() - t0
        import shlex

        cmd = os.environ.get("ENGINEPROFILES_COMMAND") or shlex.join(["probe-engine", *sys.argv[1:]])
        profile = in_situ_profile(fit, start, [c for _, _, c in pairs], families, cmd, attention_fit=att_fit)
        if self_check and not captures:
            from .selfcheck import self_check as run_self_check

            profile = run_self_check(engine, profile, families[0], seed=seed, env=env,
                                     mode="eager" if mode == "eager" else "default", note=note)
        elif self_check:
            note("self-check not run: the captures were given (--capture), the engine did not run here")
        marks["self-check"] = time.perf_counter() - t0
        ends = list(marks.values())  # each phase's end, from the start
        _write_timings({k: end - begin for k, end, begin in zip(marks, ends, [0.0, *ends])} | {"total": ends[-1]})
    except EngineProfilesError as e:
        _fail(e)
    _emit(profile, output, target, is_dir, print_yaml, extra=tables.in_situ_table(fit),
          extra_narrow=tables.in_situ_table(fit, narrow=True))


def _engine_command(engine: str):
    def command(
        device: str = typer.Option("cpu", help="device to probe on: cpu or cuda"),
        dtype: str = typer.Option("bfloat16", help="activation dtype: bfloat16 or float16"),
        mode: str = typer.Option("default", help=engines.get(engine).mode_help),
        output: Optional[str] = typer.Option(".", "-o", "--output", help=OUTPUT_HELP),
        ship: bool = typer.Option(False, "--ship", help=SHIP_HELP),
        seed: int = typer.Option(0, help="seed of the probe inputs"),
        quick: bool = typer.Option(False, help="fewer shapes (for smoke tests)"),
        region: Optional[list[str]] = typer.Option(None, help="probe only this region (repeatable): rope, swiglu, add_rmsnorm, rmsnorm, attention, moe or shared_expert; the others are recorded as not probed"),
        env: Optional[str] = typer.Option(
            None, help="engine environment (venv folder, python or version) when the engine is not importable here"
        ),
        print_yaml: bool = typer.Option(False, "--yaml", help="also print the YAML"),
        in_situ: Optional[bool] = typer.Option(
            None, "--in-situ/--op-level",
            help="in situ: run the whole engine on a tiny model and fit the profile from what it materializes "
            "(the default on CPU in bfloat16 for vLLM's compiled mode, where fusion spans layers, and for SGLang's "
            "default CPU engine); op-level: probe each region's own code (the default elsewhere, and the start of "
            "the in-situ fit)",
        ),
        family: Optional[list[str]] = typer.Option(
            None, help=f"in situ: tiny model family ({', '.join(FAMILY_NAMES)}), repeatable: one profile is fitted to all; "
            "default qwen3 (its q/k norms exercise every site)"),
        capture: Optional[list[str]] = typer.Option(None, help="in situ: reuse capture files (one per --family, in order)"),
        prompts: int = typer.Option(4, help="in situ: number of sequences"),
        rope_scaling: Optional[str] = typer.Option(
            None, help="in situ: the tiny models' RoPE scaling (their rope_parameters; default: none): llama3 (Llama "
            "3.1's: factor 8, low/high frequency factors 1/4, original context 8192), linear (factor 3), yarn (factor 4 over an original context of 10240) or dynamic (factor 2)"),
        self_check: Optional[bool] = typer.Option(
            None, "--self-check/--no-self-check", help="in situ (default on): after fitting, run the engine and exact mode with the "
            "new profile on a model of random widths and record the exact-match rates in provenance.self_check (one "
            "more engine run; not run with --capture)"),
    ) -> None:
        try:
            for f in family or ["qwen3"]:
                _check_arguments(engine, device, dtype, mode, f, region)
            _check_seed(seed)
            if rope_scaling is not None:
                from engineprofiles.names import check_rope_scaling_name

                check_rope_scaling_name(rope_scaling)
        except EngineProfilesError as e:
            _fail(e)
        if in_situ is None:
            # In situ by default where it runs: vLLM's compiled mode (fusion spans layers) and SGLang's
            # default CPU engine, on CPU in bfloat16.
            record = engines.get(engine)
            situ_modes = record.in_situ_by_default
            in_situ = mode in situ_modes and device == "cpu" and dtype == "bfloat16" and region is None and not quick
            if mode in situ_modes and not in_situ and region is None and not quick:
                what = record.title
                err.print(f"note: probing op-level: the in-situ fit runs {what} in bfloat16 only (asked: "
                          f"--dtype {dtype} --device {device}); the profile records method op-level", highlight=False,
                          markup=False)
        elif in_situ and (quick or region):
            _fail(EngineProfilesError("--quick and --region are op-level options; the in-situ fit covers every region"))
        if not in_situ and (family or capture or rope_scaling or self_check is not None):
            _fail(EngineProfilesError("--family, --capture, --self-check/--no-self-check and --rope-scaling are in-situ "
                                      "options; add --in-situ (or leave them out)"))
        if in_situ:
            record = engines.get(engine)
            if mode not in record.in_situ_modes:
                _fail(EngineProfilesError(
                    f"--in-situ runs {record.title} in its {' or '.join(record.in_situ_modes)} mode only (--mode {mode}: "
                    f"{record.in_situ_note})"))
            _in_situ(engine, list(family or ["qwen3"]), output, seed, env, list(capture or []), prompts, print_yaml, mode,
                     dtype, device, ship, rope_scaling, self_check is not False)
            return
        _probe(engine, device, dtype, mode, output, seed, quick, region, env, print_yaml, ship=ship)

    return command


def _register_engines() -> None:
    for name in engines.with_environment():
        app.command(name, help=engines.get(name).help)(_engine_command(name))

    @app.command("transformers", help=engines.get("transformers").help)
    def transformers_cmd(
        device: str = typer.Option("cpu", help="device to probe on: cpu or cuda"),
        dtype: str = typer.Option("bfloat16", help="activation dtype: bfloat16 or float16"),
        mode: str = typer.Option("default", help=f"execution mode: {engines.get('transformers').mode_help}"),
        output: Optional[str] = typer.Option(".", "-o", "--output", help=OUTPUT_HELP),
        ship: bool = typer.Option(False, "--ship", help=SHIP_HELP),
        seed: int = typer.Option(0, help="seed of the probe inputs"),
        quick: bool = typer.Option(False, help="fewer shapes (for smoke tests)"),
        region: Optional[list[str]] = typer.Option(None, help="probe only this region (repeatable): rope, swiglu, add_rmsnorm, rmsnorm, attention, moe or shared_expert; the others are recorded as not probed"),
        family: str = typer.Option("qwen2", help=f"model family whose modules are probed: {', '.join(FAMILY_NAMES)}"),
        print_yaml: bool = typer.Option(False, "--yaml", help="also print the YAML"),
        apply: Optional[str] = typer.Option(
            None, "--apply", help="probe a tiny --family model patched with this profile (emulator.apply_profile)"
        ),
    ) -> None:
        _probe("transformers", device, dtype, mode, output, seed, quick, region, None, print_yaml, family, apply, ship)


_register_engines()


def version_callback(value: bool) -> None:
    if value:
        out.print(f"probe-engine {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Optional[bool] = typer.Option(None, "--version", callback=version_callback, is_eager=True, help="print the version"),
) -> None:
    pass


def main() -> None:
    app()


def _main_exit_fast() -> None:
    """`python -m engineloop.cli`: how probe-engine runs itself in an engine's environment.

    After a probe has written its profile (atomically) and flushed its output, the process ends
    with os._exit: the interpreter's teardown of vLLM + torch + Inductor takes ~2 s on a 2-core CPU
    and does nothing the probe needs (measured with scripts/bench_probe.py). Any other command, an
    error, or an exception ends the normal way."""
    import sys

    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code
    if not (_probe_done and isinstance(code, (int, type(None)))):
        raise SystemExit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    _main_exit_fast()
