"""The README is a user's contract: short, its links resolve, and every code block in it and in the
docs it links to is valid code (Python compiles, shell passes ``bash -n``).

A block that is deliberately not valid code (a fragment) is marked by the author with the HTML
comment ``<!-- fragment -->`` on the line just above its opening fence; prefer valid code.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 220
FRAGMENT_MARK = "<!-- fragment -->"

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[^\s`]*)")
_LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\((?P<target><[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\)")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    source: str
    fragment: bool

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def code_blocks(path: Path) -> list[Block]:
    """Every fenced code block of a Markdown file, with its language tag (lower case, may be empty)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group("indent"), m.group("fence"), m.group("lang").lower()
        start = i
        fragment = start > 0 and lines[start - 1].strip() == FRAGMENT_MARK
        body: list[str] = []
        i += 1
        while i < len(lines):
            close = lines[i].strip()
            if close.startswith(fence[0] * len(fence)) and set(close) <= {fence[0]}:
                break
            line = lines[i]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            i += 1
        else:
            raise AssertionError(f"{path.relative_to(ROOT)}:{start + 1}: code block never closed")
        blocks.append(Block(path, start + 1, lang, "\n".join(body) + "\n", fragment))
        i += 1
    return blocks


def _strip_code(text: str, inline: bool = True) -> str:
    """The text without fenced blocks and (``inline``) code spans: links inside code are not links."""
    out, in_fence, fence = [], False, ""
    for line in text.splitlines():
        m = _FENCE.match(line)
        if m and not in_fence:
            in_fence, fence = True, m.group("fence")[0] * len(m.group("fence"))
            continue
        if in_fence:
            if line.strip().startswith(fence) and set(line.strip()) <= {fence[0]}:
                in_fence = False
            continue
        out.append(re.sub(r"`[^`]*`", "", line) if inline else line)
    return "\n".join(out)


def relative_links(path: Path) -> list[str]:
    """The targets of the Markdown links of a file that are neither URLs nor in-page anchors."""
    targets = []
    for m in _LINK.finditer(_strip_code(path.read_text(encoding="utf-8"))):
        target = m.group("target").strip("<>")
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target)
    return targets


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for line in _strip_code(path.read_text(encoding="utf-8"), inline=False).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = _slug(m.group(1))
            n, candidate = 0, slug
            while candidate in found:
                n += 1
                candidate = f"{slug}-{n}"
            found.add(candidate)
    return found


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve()
        if not dest.exists():
            broken.append(f"{target} (no such file: {dest})")
        elif anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            broken.append(f"{target} (no heading with anchor #{anchor} in {dest.name})")
    return broken


def linked_docs() -> list[Path]:
    """The Markdown files under docs/ that the README links to."""
    docs = []
    for target in relative_links(README):
        dest = (ROOT / unquote(target.partition("#")[0])).resolve()
        if dest.suffix == ".md" and dest.parent == ROOT / "docs" and dest.exists() and dest not in docs:
            docs.append(dest)
    return docs


DOCUMENTS = [README, *linked_docs()]
BLOCKS = [b for doc in DOCUMENTS for b in code_blocks(doc)]
PYTHON_BLOCKS = [b for b in BLOCKS if b.lang in ("python", "py", "python3")]
SHELL_BLOCKS = [b for b in BLOCKS if b.lang in ("bash", "sh", "shell")]


def test_the_readme_has_at_most_220_lines():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; at most {MAX_README_LINES}: move detail into docs/"


def test_the_readme_opens_with_the_two_setup_commands():
    first = code_blocks(README)[0]
    commands = [line.split("#")[0].strip() for line in first.source.splitlines() if line.strip()]
    assert first.lang == "bash" and commands == ["scripts/probe.sh vllm", "scripts/test.sh"], first.source


def test_every_relative_link_in_the_readme_points_to_an_existing_file():
    assert relative_links(README), "no relative link found: the link pattern is broken"
    assert broken_links(README) == []


@pytest.mark.parametrize("doc", DOCUMENTS[1:], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_in_a_doc_the_readme_links_to_points_to_an_existing_file(doc):
    assert broken_links(doc) == []


def test_the_readme_links_to_docs_and_they_have_code_to_check():
    assert len(DOCUMENTS) > 5, [str(d) for d in DOCUMENTS]
    assert PYTHON_BLOCKS and SHELL_BLOCKS


# blocks marked as fragments are not checked (and not collected: nothing here is skipped)
@pytest.mark.parametrize("block", [b for b in PYTHON_BLOCKS if not b.fragment], ids=lambda b: b.id)
def test_every_python_block_in_the_readme_and_its_docs_compiles(block):
    compile(block.source, block.id, "exec")


@pytest.mark.parametrize("block", [b for b in SHELL_BLOCKS if not b.fragment], ids=lambda b: b.id)
def test_every_shell_block_in_the_readme_and_its_docs_passes_bash_n(block):
    res = subprocess.run(["bash", "-n"], input=block.source, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, f"{block.id}: bash -n: {res.stderr}"


def test_the_fence_parser_finds_blocks_and_their_languages(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("text\n```python\nx = 1\n```\n\n<!-- fragment -->\n```bash\nif then\n```\n  ```\n  plain\n  ```\n")
    blocks = code_blocks(doc)
    assert [(b.lang, b.source, b.fragment) for b in blocks] == [
        ("python", "x = 1\n", False), ("bash", "if then\n", True), ("", "plain\n", False)]


def test_a_broken_link_is_reported(tmp_path):
    (tmp_path / "there.md").write_text("# A `code` heading: yes\n")
    doc = tmp_path / "x.md"
    doc.write_text("[ok](there.md) [ok](there.md#a-code-heading-yes) [url](https://example.org/none) `[no](code.md)`\n"
                   "[bad](missing.md) [bad anchor](there.md#nope)\n")
    assert [b.split(" ")[0] for b in broken_links(doc)] == ["missing.md", "there.md#nope"]
