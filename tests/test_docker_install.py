"""The Dockerfile, without a Docker engine: its install step (``docker/install.sh``) and its start
command run here in a clean virtual environment, and the image's properties are read from it.

The venv gets loraplex from this checkout as the image does (a regular, not an editable,
install), the embedded model is prepared with ``loraplex prepare`` (the image's build step), and
``loraplex serve --host ...`` must answer the image's HEALTHCHECK.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from loraplex.engine.default_model import embedded_model_dir

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = (REPO / "Dockerfile").read_text()


def _instruction(name: str) -> list[str]:
    """The arguments of every ``name`` instruction (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    return [m.group(1).strip() for m in re.finditer(rf"^{name}\s+(.*)$", text, re.MULTILINE)]


def test_the_dockerfile_builds_what_the_issue_asks_for() -> None:
    assert "ARG VARIANT=cpu" in DOCKERFILE  # CPU by default...
    assert {"base-cpu", "base-cuda"} <= {a.split()[-1] for a in _instruction("FROM")}
    assert "FROM base-${VARIANT}" in DOCKERFILE  # ...CUDA by build argument
    users = _instruction("USER")
    assert users and users[-1] not in ("root", "0")
    assert json.loads(_instruction("VOLUME")[-1]) == ["/data"]
    assert any("LORAPLEX_DATA_DIR=/data" in e for e in _instruction("ENV"))
    health = _instruction("HEALTHCHECK")[-1]
    assert "/health" in health and "CMD" in health
    assert json.loads(_instruction("ENTRYPOINT")[-1]) == ["loraplex", "serve", "--host", "0.0.0.0"]
    runs = _instruction("RUN")
    assert "sh /src/docker/install.sh /src /opt/loraplex && rm -rf /src" in runs
    assert "loraplex prepare" in runs  # the model is converted at build time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthcheck_command(port: int) -> list[str]:
    """The HEALTHCHECK's command, on ``port``."""
    health = _instruction("HEALTHCHECK")[-1]
    exec_form = json.loads(health.split("CMD", 1)[1].strip())
    return [part.replace("8000", str(port)) for part in exec_form]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_install_and_start_commands_work_in_a_clean_venv(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LORAPLEX_", "VIRTUAL_ENV"))}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
    # The image's environment, with its paths under tmp_path (pip's own index for torch here).
    cache, data = tmp_path / "cache", tmp_path / "data"
    env.update(LORAPLEX_CACHE_DIR=str(cache), LORAPLEX_DATA_DIR=str(data), HF_HUB_OFFLINE="1")
    env["LORAPLEX_TORCH_INDEX"] = ""
    converted = embedded_model_dir()
    if converted.is_dir():  # the (slow) conversion is tested elsewhere; reuse its result
        target = cache / converted.relative_to(converted.parents[1])
        shutil.copytree(converted, target)

    install = ["sh", str(REPO / "docker" / "install.sh"), str(REPO), str(venv)]
    run = {"env": env, "cwd": tmp_path, "capture_output": True, "text": True}  # not this checkout
    done = subprocess.run(install, **run, timeout=800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    site = subprocess.run(
        # psycopg: the image serves platform replicas on PostgreSQL (the postgres extra)
        [str(venv / "bin" / "python"), "-c", "import loraplex, psycopg, torch; print(loraplex.__file__)"],
        **run, check=True,
    )  # fmt: skip
    assert str(venv) in site.stdout, site.stdout  # the venv's own copy, not this checkout

    prepared = subprocess.run(["loraplex", "prepare"], **run, timeout=300)
    assert prepared.returncode == 0, prepared.stderr
    assert Path(prepared.stdout.strip()).is_dir() and "native CPU kernels built" in prepared.stderr

    port = _free_port()
    entrypoint = json.loads(_instruction("ENTRYPOINT")[-1])
    command = [*entrypoint[:-1], "127.0.0.1", "--port", str(port)]  # the image binds 0.0.0.0
    proc = subprocess.Popen(
        command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            check = subprocess.run(_healthcheck_command(port), **run)
            if check.returncode == 0:
                break
            assert time.monotonic() < deadline, f"{shlex.join(command)} never became healthy"
            time.sleep(0.5)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            assert json.load(r)["status"] == "ok"
        assert (data / "loraplex.db").is_file()
        assert (data.stat().st_mode & 0o777) == 0o700
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    assert code == 0
