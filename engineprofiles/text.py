"""Printing strings that come from files (a profile's provenance.command, notes, device; a capture's
engine fields; an error message quoting them) without letting them drive the terminal.

:func:`printable` writes every control character as its Python escape (``\\x1b``, ``\\x07``,
``\\u202e``): C0 controls but tab and newline, DEL, C1 controls (``\\x9b`` is a CSI on some
terminals) and the bidirectional overrides, which reorder what is shown. :class:`PrintableHook`
applies it to everything a rich Console prints (probe-engine installs it on its consoles), after
layout: rich's own styling is not text and is kept. Machine-readable output (JSON, YAML) is written
escaped by its own encoder and is not printed through such a console.
"""

from __future__ import annotations

import re
from typing import Iterable

from rich.console import Console, RenderHook
from rich.measure import Measurement
from rich.segment import Segment

_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` with its control characters (all but tab and newline) written as Python escapes, as
    repr() writes them: shown, never executed by the terminal."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def has_control(text: str) -> bool:
    return _CONTROL.search(text) is not None


class _Printable:
    """A renderable whose text segments go through :func:`printable` (control segments, rich's own
    cursor and screen commands, pass as they are)."""

    def __init__(self, renderable):
        self.renderable = renderable

    def __rich_console__(self, console, options) -> Iterable[Segment]:
        for seg in console.render(self.renderable, options):
            if seg.control or not has_control(seg.text):
                yield seg
            else:
                yield Segment(printable(seg.text), seg.style)

    def __rich_measure__(self, console, options) -> Measurement:
        return Measurement.get(console, options, self.renderable)


class PrintableHook(RenderHook):
    """A rich render hook: what the console prints goes through :func:`printable`."""

    def process_renderables(self, renderables):
        return [_Printable(r) for r in renderables]


def install(console: Console) -> Console:
    """Make ``console`` print every string through :func:`printable`; returns it."""
    console.push_render_hook(PrintableHook())
    return console
