"""probe-engine: the command line. Thin: it parses, calls the library, prints."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from . import __version__, render, store
from .errors import EngineProfilesError

app = typer.Typer(
    help="Measure where an inference engine rounds to BF16/FP16 (RoPE, SwiGLU, residual RMSNorm), "
    "and read, check and compare the resulting profiles.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True)


def _fail(e: Exception, code: int = 2) -> None:
    err.print(f"[red]error:[/red] {e}", highlight=False)
    raise typer.Exit(code)


@app.command()
def validate(profiles: list[str] = typer.Argument(..., help="profile files or shipped names")) -> None:
    """Check profiles against the schema; exit 1 if any is invalid."""
    bad = 0
    for name in profiles:
        try:
            p = store.get_profile(name)
        except EngineProfilesError as e:
            err.print(f"[red]invalid[/red] {e}", highlight=False)
            bad += 1
            continue
        out.print(f"[green]ok[/green] {name}: {p.engine.name} {p.engine.version} {p.engine.backend} {p.dtype}", highlight=False)
    if bad:
        raise typer.Exit(1)


@app.command()
def show(profile: str = typer.Argument(..., help="a profile file or shipped name")) -> None:
    """Print a profile's rounding sites per region, with the evidence behind them."""
    try:
        p = store.get_profile(profile)
    except EngineProfilesError as e:
        _fail(e)
    render.show(p, out, name=profile)


@app.command("list")
def list_profiles() -> None:
    """List the profiles shipped in profiles/ (engine, version, backend, mode, dtype)."""
    d = store.shipped_dir()
    names = store.shipped_names()
    if not names:
        out.print(f"no shipped profiles in {d}")
        return
    t = Table(title=f"shipped profiles ({d})")
    for col in ("name", "engine", "version", "backend", "mode", "dtype", "method", "date"):
        t.add_column(col)
    for n in names:
        try:
            p = store.get_profile(n)
        except EngineProfilesError as e:
            t.add_row(n, f"[red]invalid: {e}[/red]", "", "", "", "", "", "")
            continue
        e = p.engine
        t.add_row(n, e.name, e.version, e.backend, e.execution_mode, p.dtype, p.provenance.method, p.provenance.date[:10])
    out.print(t)


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


if __name__ == "__main__":
    main()
