"""Code comments cite the command that measures a claim, never one machine's figures (issue 35):
figures rot, and a reader cannot tell which machine they came from. The figures themselves live
in docs/benchmarks.md with their commands; the experiments in benchmarks/.

What counts as a figure (``FIGURE``): in a comment (``#``, ``//``, ``/* */``) or a docstring of a
file under loraplex/, a number or a range followed by a unit of time (``ms``, ``µs``, ``us``,
``ns``, or `` s`` after a space), of speed (``GFLOP/s``, ``GB/s``, ``MB/s``, ``tokens/s``,
``tok/s``), a ratio with a fraction or a range (``1.5x``, ``1.3-1.6x``) or said to be faster or
slower (``10x faster``), or a percentage said to be faster, slower, more or less.
Code literals in double backticks (``"250ms"``) are examples, not figures, and are skipped.
A setting is written so that it is not a figure: its constant's name, or words ("two seconds").
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "loraplex"

NUMBER = r"(?<![\w.])~?\d+(?:\.\d+)?(?:\s?-\s?\d+(?:\.\d+)?)?"  # 12, 1.5, ~45, 5-15
FIGURE = re.compile(
    NUMBER + r"\s?(?:ms|µs|us|ns|GFLOP/s|GB/s|MB/s|tokens/s|tok/s)(?!\w)"  # 3 ms, 17 GB/s
    "|" + NUMBER + r"\ss(?!\w)"  # 0.7 s
    "|" + NUMBER + r"\s?%\s(?:faster|slower|more|less)"  # 5% faster
    # a ratio with a fraction or a range (1.5x, 1.3-1.6x), or said faster/slower (10x faster);
    # a bound such as "over 10x the smallest" is a setting
    r"|(?<![\w.])\d+\.\d+(?:\s?-\s?\d+(?:\.\d+)?)?\s?[x×](?!\w)"
    r"|(?<![\w.])\d+\s?-\s?\d+(?:\.\d+)?\s?[x×](?!\w)"
    r"|(?<![\w.])\d+\s?[x×]\s(?:faster|slower)"
)
CODE_LITERAL = re.compile(r"``.*?``")


def _python_comments(src: str) -> list[tuple[int, str]]:
    out = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(src).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(src)):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = node.body[0] if node.body else None
        if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
            text = doc.value.value
            if isinstance(text, str):
                out += [(doc.lineno + i, line) for i, line in enumerate(text.splitlines())]
    return out


def _c_comments(src: str) -> list[tuple[int, str]]:
    out = []
    for m in re.finditer(r"//[^\n]*|/\*.*?\*/", src, re.S):
        first = src.count("\n", 0, m.start()) + 1
        out += [(first + i, line) for i, line in enumerate(m.group().splitlines())]
    return out


def figures(path: Path) -> list[str]:
    """``path:line: text`` for each comment or docstring line of ``path`` that quotes a figure."""
    src = path.read_text(encoding="utf-8")
    lines = _python_comments(src) if path.suffix == ".py" else _c_comments(src)
    return [
        f"{path.relative_to(ROOT.parent)}:{n}: {text.strip()}"
        for n, text in lines
        if FIGURE.search(CODE_LITERAL.sub("", text))
    ]


def _sources() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*") if p.suffix in (".py", ".c", ".h"))


@pytest.mark.parametrize(
    ("text", "hit"),
    [
        ("# took 21.9 to 19.5 ms", True),
        ("# 1.09-1.18x faster", True),
        ("(16: 0.7 s, 20: > 30 s)", True),
        ("at 17 GB/s where", True),
        ("ran 5% faster than", True),
        ("# ~45 s on first start", True),
        ("# 400s name the field", False),
        ('OpenAI\'s reset format: ``"250ms"``, ``"6s"``', False),
        ("# the first 10% of steps", False),
        ("# 5e-324 made it +inf", False),
        ("# 10x faster than two", True),
        ("# over 10x the smallest", False),
        ("# 1.2-2x MKL at 8-64 rows", True),
    ],
)
def test_the_pattern(text: str, hit: bool) -> None:
    assert bool(FIGURE.search(CODE_LITERAL.sub("", text))) is hit


def test_no_comment_under_loraplex_quotes_a_machine_timing() -> None:
    found = [hit for path in _sources() for hit in figures(path)]
    assert not found, "cite the benchmark command instead (docs/benchmarks.md keeps figures):\n" + (
        "\n".join(found)
    )
