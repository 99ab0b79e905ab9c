"""The documentation's fenced examples and relative links: README.md and docs/**/*.md.

An example is a fenced ``bash`` or ``python`` block; the line before its fence (blank lines
skipped) says whether the examples test runs it: ``<!-- runnable -->`` or ``<!-- not-runnable -->``
(docs/README.md states the rule). Invariant: ``Example.code`` is the block exactly as a reader
pastes it (the fence's own indentation removed, nothing else changed)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNNABLE = "<!-- runnable -->"
NOT_RUNNABLE = "<!-- not-runnable -->"
LANGUAGES = ("bash", "python")
_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w+-]*)\s*$")
_LINK = re.compile(r"\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")


@dataclass(frozen=True)
class Example:
    path: Path  # relative to the repository root
    line: int  # the opening fence's, 1-based
    lang: str  # "" for a fence without a language
    code: str
    marker: str | None  # RUNNABLE, NOT_RUNNABLE or None

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md then docs/**/*.md, sorted: the order the examples test runs them in."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def examples(path: Path, root: Path = ROOT) -> list[Example]:
    """Every fenced block of ``path`` in order, with the marker before it."""
    lines = path.read_text(encoding="utf-8").split("\n")
    found: list[Example] = []
    previous = ""  # the last non-blank line outside a fence
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            if lines[i].strip():
                previous = lines[i].strip()
            i += 1
            continue
        indent, start = len(opening["indent"]), i
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            line = lines[i]
            body.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
            i += 1
        marker = previous if previous in (RUNNABLE, NOT_RUNNABLE) else None
        rel = path.relative_to(root)
        found.append(Example(rel, start + 1, opening["lang"], "\n".join(body) + "\n", marker))
        previous = ""
        i += 1
    return found


def relative_links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link of ``path`` that is not a URL or an in-page anchor,
    outside fenced blocks."""
    links: list[tuple[int, str]] = []
    in_fence = False
    for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), start=1):
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        for match in _LINK.finditer(line):
            target = match["target"]
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue
            links.append((number, target))
    return links
