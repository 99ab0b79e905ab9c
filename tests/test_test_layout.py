"""The tests mirror the source tree and share code only through ``tests/utils``: no module imports
a test module or a conftest (pytest loads those itself), every test file sits in a folder that
mirrors a real subpackage of ``loraplex``, and no folder keeps the tests of a subpackage that has
a test folder of its own."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SOURCE = TESTS.parent / "loraplex"


def _is_test_module(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return last.startswith("test_") or last == "conftest"


def forbidden_imports(source: str, module: str) -> list[str]:
    """The test modules and conftest files that ``source`` (the module named ``module``, a
    dotted name under ``tests``) imports, as dotted names."""
    package = module.rsplit(".", 1)[0]
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the module's package
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(p for p in [*parts, base] if p)
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            if (name == "tests" or name.startswith("tests.")) and _is_test_module(name):
                found.append(name)
    return found


def _modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _dotted(path: Path) -> str:
    return ".".join(("tests", *path.relative_to(TESTS).with_suffix("").parts))


def _test_files() -> list[Path]:
    return [p for p in _modules() if p.name.startswith("test_")]


def test_the_import_check_finds_imports_of_tests_and_conftests() -> None:
    bad = (
        "from tests.platform import test_malformed\n"
        "from tests.platform.conftest import make_app\n"
        "import tests.engine.test_client\n"
        "from .test_browser import shot\n"
        "def f():\n    from tests.lora.test_adapter import make_peft\n"
    )
    assert forbidden_imports(bad, "tests.webui.test_x") == [
        "tests.platform.test_malformed",
        "tests.platform.conftest",
        "tests.engine.test_client",
        "tests.webui.test_browser",
        "tests.lora.test_adapter",
    ]
    good = "from tests.utils import registry as rf\nfrom tests.utils.app import make_app\n"
    assert forbidden_imports(good, "tests.platform.test_x") == []


def test_no_module_imports_a_test_module_or_a_conftest() -> None:
    modules = _modules()
    assert len(modules) > 50, "the tests were not found"
    imports = {
        str(path.relative_to(TESTS)): imported
        for path in modules
        if (imported := forbidden_imports(path.read_text(), _dotted(path)))
    }
    assert imports == {}, f"move what these import into tests/utils: {imports}"


def test_every_folder_of_tests_is_a_package() -> None:
    folders = {p.parent for p in _modules()}
    missing = sorted(
        str(f.relative_to(TESTS.parent)) for f in folders if not (f / "__init__.py").exists()
    )
    assert missing == []


def test_every_test_file_mirrors_a_source_package() -> None:
    assert _test_files(), "no test files found"
    misplaced = []
    for path in _test_files():
        folder = path.parent.relative_to(TESTS)
        if not (SOURCE / folder / "__init__.py").exists():
            misplaced.append(str(path.relative_to(TESTS)))
    assert misplaced == [], f"these tests sit in no mirror of a loraplex package: {misplaced}"


def test_no_folder_keeps_the_tests_of_a_subpackage_with_its_own_folder() -> None:
    """``tests/platform/test_registry_x.py`` belongs in ``tests/platform/registry/`` once that
    exists (a module named like the subpackage, ``engine_args.py`` beside ``engine/``, is fine)."""
    strays = []
    for path in _test_files():
        folder = path.parent
        stem = path.stem.removeprefix("test_")
        source = SOURCE / folder.relative_to(TESTS)
        for sub in folder.iterdir():
            if not (sub / "__init__.py").exists() or sub.name == "utils":
                continue
            named = stem == sub.name or stem.startswith(f"{sub.name}_")
            if named and not (source / f"{stem}.py").exists():
                strays.append(f"{path.relative_to(TESTS)} -> {sub.relative_to(TESTS)}/")
    assert strays == []
