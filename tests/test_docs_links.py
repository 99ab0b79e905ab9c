"""Every relative link in README.md and docs/**/*.md names a file or folder of the repository
(the part before any ``#anchor``), and no link leaves the repository (issue 35: the README
pointed to ``../shared/DESIGN.md``); every bash/python example carries its runnable marker."""

from __future__ import annotations

from pathlib import Path

from tests.utils.docs import (
    LANGUAGES,
    NOT_RUNNABLE,
    ROOT,
    RUNNABLE,
    doc_files,
    examples,
    relative_links,
)


def broken_links(files: list[Path], root: Path) -> list[str]:
    broken = []
    for path in files:
        for line, target in relative_links(path):
            resolved = (path.parent / target.split("#", 1)[0]).resolve()
            where = f"{path.relative_to(root)}:{line}: {target}"
            if not resolved.is_relative_to(root):
                broken.append(f"{where} (outside the repository)")
            elif not resolved.exists():
                broken.append(f"{where} (no such file)")
    return broken


def test_the_check_finds_a_missing_file_and_a_link_outside(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md#x) [web](https://example.com) [here](#top)\n"
        "[gone](docs/b.md) [out](../shared/DESIGN.md)\n```\n[in a fence](nowhere.md)\n```\n"
    )
    assert broken_links(doc_files(tmp_path), tmp_path) == [
        "README.md:2: docs/b.md (no such file)",
        "README.md:2: ../shared/DESIGN.md (outside the repository)",
    ]


def test_every_relative_link_resolves() -> None:
    files = doc_files()
    assert len(files) > 10, "the docs were not found"
    assert broken_links(files, ROOT) == []


def test_every_example_says_whether_it_runs() -> None:
    unmarked = [
        ex.where for path in doc_files() for ex in examples(path) if ex.lang in LANGUAGES
        if ex.marker is None
    ]  # fmt: skip
    assert unmarked == [], (
        "put <!-- runnable --> or <!-- not-runnable --> (with the reason in the text) on the "
        f"line before each of these fences (docs/README.md): {unmarked}"
    )


def test_examples_are_read_as_pasted_with_their_markers(tmp_path: Path) -> None:
    doc = tmp_path / "a.md"
    doc.write_text(
        "<!-- runnable -->\n\n```bash\necho hi\n```\n"
        "* a list item:\n\n  <!-- not-runnable -->\n  ```python\n  for x in y:\n      f(x)\n  ```\n"
        "text\n```python\nplain()\n```\n"
    )
    found = [(ex.line, ex.lang, ex.code, ex.marker) for ex in examples(doc, tmp_path)]
    assert found == [
        (3, "bash", "echo hi\n", RUNNABLE),
        (9, "python", "for x in y:\n    f(x)\n", NOT_RUNNABLE),
        (14, "python", "plain()\n", None),
    ]
