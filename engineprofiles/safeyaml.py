"""Reading untrusted YAML text files with bounded cost, and echoing bad values briefly.

``yaml.safe_load`` builds no arbitrary objects, but it accepts duplicate keys (the last one wins,
silently), expands aliases without limit (a few KB can stand for gigabytes, which an error message
that echoes the value then prints) and recurses once per nesting level. The loader here refuses
all three; :func:`short` is the only way a message shows a value read from a file.
"""

from __future__ import annotations

import os
import reprlib
import stat
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

MAX_FILE_BYTES = 1 << 20  # shipped profiles are ~10 KB
MAX_DEPTH = 32  # a profile nests 6 deep
MAX_EXPANDED = 2 * MAX_FILE_BYTES  # nodes plus scalar characters, aliases expanded
MERGE_TAG = "tag:yaml.org,2002:merge"

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 80
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 4
_repr.maxlevel = 3


def short(value: Any, limit: int = 160) -> str:
    """repr(value), cut to about ``limit`` characters without building the whole repr."""
    s = _repr.repr(value)
    return s if len(s) <= limit else s[: limit - 3] + "..."


class Refused(yaml.YAMLError):
    """The text is valid YAML, but not one this loader reads (``line`` is 1-based, or None)."""

    def __init__(self, message: str, line: int | None = None):
        super().__init__(message)
        self.message, self.line = message, line


class NotText(ValueError):
    """The file cannot be read as a YAML text file (not a regular file, too large, not UTF-8)."""


def read_text(path: str | os.PathLike[str], max_bytes: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of a regular file of at most ``max_bytes``. Raises :class:`NotText` (what is
    wrong with the content) or ``OSError`` (what the OS said)."""
    p = Path(path)
    st = os.stat(p)
    if not stat.S_ISREG(st.st_mode):
        raise NotText("not a regular file")
    with open(p, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise NotText(f"larger than {max_bytes} bytes; a profile is a small YAML text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NotText(
            f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); a profile is a YAML text file "
            "in UTF-8: is this the right file?"
        ) from None


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys, deep nesting and alias expansion beyond a limit."""

    def __init__(self, stream: Any):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise Refused(f"nested more than {MAX_DEPTH} deep; a profile nests a few levels", mark.line + 1)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_node(self) -> Node | None:
        node = super().get_single_node()
        if node is not None:
            _check_expansion(node)
        return node

    def construct_mapping(self, node: Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, MappingNode):
            seen: dict[Any, Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == MERGE_TAG or not isinstance(key_node, ScalarNode):
                    continue
                key = self.construct_object(key_node)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:
                    continue
                if first is not key_node:
                    a, b = first.start_mark.line + 1, key_node.start_mark.line + 1
                    raise Refused(
                        f"duplicate key {short(key)} at line {a} and line {b}; a key appears once in a mapping: "
                        "remove one of them", b)
        return super().construct_mapping(node, deep)


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [n for kv in node.value for n in kv]
    return []


def _check_expansion(root: Node) -> None:
    """Refuse a document whose aliases expand it beyond MAX_EXPANDED (nodes plus scalar
    characters) or refer to themselves. Linear in the text: each node is sized once."""
    sizes: dict[int, int] = {}
    started: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            started.discard(key)
            size = 1 + (len(node.value) if isinstance(node, ScalarNode) else 0)
            size += sum(sizes[id(c)] for c in _children(node))
            if size > MAX_EXPANDED:
                raise Refused(
                    f"YAML aliases expand this document beyond {MAX_EXPANDED} nodes and characters (an alias bomb?); "
                    "a profile needs no alias expansion", node.start_mark.line + 1)
            sizes[key] = size
            continue
        if key in sizes:
            continue
        if key in started:
            raise Refused("a YAML alias refers to the node that contains it (a recursive alias)", node.start_mark.line + 1)
        started.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node))


def load(text: str, max_bytes: int = MAX_FILE_BYTES) -> Any:
    """Parse ``text`` with :class:`StrictLoader` (errors: ``yaml.YAMLError``, :class:`Refused`); text of
    more than ``max_bytes`` (UTF-8) is refused as too large, as a file of that size is (:func:`read_text`)
    and before the alias check could take it for an alias bomb."""
    size = len(text.encode("utf-8", "surrogatepass")) if len(text) * 4 > max_bytes else len(text)
    if size > max_bytes:
        raise Refused(f"the text is {size} bytes, larger than the limit of {max_bytes} bytes; a profile is a small "
                      "YAML text (the shipped ones ~10 KB)")
    try:
        return yaml.load(text, Loader=StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise Refused("nested too deep to read") from None
