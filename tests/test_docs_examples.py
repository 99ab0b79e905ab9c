"""Every example of README.md and docs/**/*.md marked ``<!-- runnable -->`` runs as pasted
against one ``loraplex serve --demo`` (issue 35: the tokenize, json_schema and choice curls
lacked a Content-Type, the ``.parse()`` example asked for a model the demo does not have, the
PATCH example used an undefined ``$ID``).

The server is started as a newcomer starts it: ``LORAPLEX_ADMIN_TOKEN`` chosen beforehand, the
demo key read from the ``export OPENAI_API_KEY=...`` line that ``serve --demo`` prints. The
examples get the variables docs/README.md tells readers to set, and run in document order from
the repository root: bash under ``bash -euo pipefail``, python through the interpreter; each
must exit 0."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.utils.docs import ROOT, RUNNABLE, Example, doc_files, examples
from tests.utils.serve import Serve

pytestmark = pytest.mark.slow

EXAMPLE_TIMEOUT_S = 120
KEY_LINE = re.compile(r"^\s*export OPENAI_API_KEY=(?P<key>lpx_\S+)\s*$")


def _runnable(path: Path) -> list[Example]:
    return [ex for ex in examples(path) if ex.marker == RUNNABLE]


def _documents() -> list[Path]:
    return [p for p in doc_files() if _runnable(p)]


def _read_key(serve: Serve, lines: list[str], deadline_s: float = 60) -> str:
    """Drain the server's output for the rest of its life (a full pipe would stall it) and return
    the demo key it printed."""
    assert serve.proc is not None and serve.proc.stdout is not None
    stdout = serve.proc.stdout

    def drain() -> None:
        for line in stdout:
            lines.append(line)

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for line in list(lines):
            if match := KEY_LINE.match(line):
                return match["key"]
        time.sleep(0.1)
    pytest.fail("serve --demo printed no `export OPENAI_API_KEY=...` line:\n" + "".join(lines))


@pytest.fixture(scope="module")
def demo_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    data = tmp_path_factory.mktemp("demo-data")
    token = "lpxadm_" + secrets.token_urlsafe(24)
    serve = Serve(["--demo", "--data-dir", str(data)], {"LORAPLEX_ADMIN_TOKEN": token}).start()
    lines: list[str] = []
    try:
        key = _read_key(serve, lines)
        pythonpath = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH")] if p)
        yield {
            **os.environ,
            "LORAPLEX_URL": serve.base,
            "OPENAI_BASE_URL": f"{serve.base}/v1",
            "OPENAI_API_KEY": key,
            "LORAPLEX_ADMIN_TOKEN": token,
            "LORAPLEX_DATA_DIR": str(data),  # the `loraplex admin` commands' database
            "PYTHONPATH": pythonpath,  # the `loraplex` command finds the checkout
        }
    finally:
        serve.stop()


def _run(example: Example, env: dict[str, str]) -> str | None:
    """None when ``example`` exits 0, else what went wrong."""
    argv = ["bash", "-euo", "pipefail", "-c", example.code]
    if example.lang == "python":
        argv = [sys.executable, "-c", example.code]
    try:
        done = subprocess.run(
            argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return f"{example.where}: still running after {EXAMPLE_TIMEOUT_S} s\n{example.code}"
    if done.returncode == 0:
        return None
    return (
        f"{example.where}: exit {done.returncode}\n{example.code}"
        f"--- stdout\n{done.stdout[-2000:]}--- stderr\n{done.stderr[-2000:]}"
    )


@pytest.mark.parametrize("document", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_runnable_examples_run_as_pasted(document: Path, demo_env: dict[str, str]) -> None:
    runnable = _runnable(document)
    assert runnable, f"{document} has no example marked {RUNNABLE}"
    failures = [failure for ex in runnable if (failure := _run(ex, demo_env)) is not None]
    assert failures == [], f"{len(failures)} of {len(runnable)} failed:\n\n" + "\n\n".join(failures)
