"""benchmarks._server.wait_healthy: the one server-start loop of the benchmarks."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from benchmarks._server import free_port, wait_healthy
from tests.utils.health_stub import HEALTH_SERVER

HEALTH = HEALTH_SERVER + "import sys\nserve_health(int(sys.argv[1]))\n"


def test_returns_once_health_answers(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", HEALTH, str(port)], stdout=out)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", log, timeout_s=30, interval_s=0.05)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


EXITS = "import sys; print('bad flag --nope'); sys.exit(3)"
SAYS = r"the server exited \(3\):\nbad flag --nope"


def test_a_server_that_exits_is_one_message_with_its_last_words(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", EXITS], stdout=out)
    with pytest.raises(SystemExit, match=SAYS):
        wait_healthy(proc, f"http://127.0.0.1:{free_port()}", log, timeout_s=30, interval_s=0.05)
    proc.wait()


def test_the_log_may_be_the_open_nameless_file_the_server_writes() -> None:
    with tempfile.TemporaryFile("w+") as log:  # as event_loop_latency's
        proc = subprocess.Popen([sys.executable, "-c", EXITS], stdout=log)
        with pytest.raises(SystemExit, match=SAYS):
            wait_healthy(
                proc, f"http://127.0.0.1:{free_port()}", log, timeout_s=30, interval_s=0.05
            )
        proc.wait()


def test_a_server_never_healthy_is_killed(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('slow'); time.sleep(60)"],
                            stdout=(tmp_path / "s.log").open("w"))  # fmt: skip
    with pytest.raises(SystemExit, match=r"not healthy in 0.3 s"):
        wait_healthy(proc, f"http://127.0.0.1:{free_port()}", tmp_path / "s.log", timeout_s=0.3,
                     interval_s=0.05)  # fmt: skip
    assert proc.wait(10) != 0
