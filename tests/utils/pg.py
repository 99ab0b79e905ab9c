"""A throwaway PostgreSQL server for the tests: started once per session, removed at the end.

``PostgresServer.start()`` runs ``initdb`` into a fresh temporary directory and starts
``postgres`` on a free port of 127.0.0.1 (trust authentication, no fsync: the cluster is
disposable). As root, both run as the ``postgres`` OS user, since PostgreSQL refuses to run as
root. The server is the test process's own child and gets SIGQUIT when that process dies, even by
SIGKILL, so no server outlives its test run. ``unavailable()`` says why no server can be had here
(the tests then skip with that reason).

Each test gets its own database: ``create_database()`` copies a template database that was
migrated once (``CREATE DATABASE ... TEMPLATE``), which is far faster than migrating each one.
"""

from __future__ import annotations

import atexit
import ctypes
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import create_engine, text

APT_HINT = "install it with: apt-get update && apt-get install -y postgresql"
TEMPLATE_DB = "loraplex_template"


def find_bin_dir() -> Path | None:
    """The directory of ``initdb``/``pg_ctl``: on PATH, or Debian's /usr/lib/postgresql/N/bin."""
    on_path = shutil.which("pg_ctl")
    if on_path is not None and shutil.which("initdb") is not None:
        return Path(on_path).resolve().parent
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    return Path(candidates[-1]).parent if candidates else None


def unavailable() -> str | None:
    """Why a PostgreSQL server cannot be started here; None when it can."""
    bin_dir = find_bin_dir()
    if bin_dir is None:
        return f"PostgreSQL is not installed (no initdb/pg_ctl found); {APT_HINT}"
    for name in ("initdb", "pg_ctl", "postgres"):
        if not (bin_dir / name).exists():
            return f"PostgreSQL's {name} is missing from {bin_dir}; {APT_HINT}"
    if os.geteuid() == 0:
        try:
            import pwd

            pwd.getpwnam("postgres")
        except KeyError:
            return (
                "running as root and there is no 'postgres' OS user to run PostgreSQL as; "
                f"{APT_HINT} (it creates the user)"
            )
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "the psycopg driver is not installed; pip install 'psycopg[binary]'"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PR_SET_PDEATHSIG = 1
STALE_AFTER_S = 3600


def _as_server_user(die_with_parent: bool) -> Callable[[], None]:
    """A ``preexec_fn``: become ``postgres`` (when root), then ask for SIGQUIT when the parent
    dies (after the uid change, which would clear the request)."""

    def preexec() -> None:
        os.setsid()
        if os.geteuid() == 0:
            import pwd

            user = pwd.getpwnam("postgres")
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
        if die_with_parent:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGQUIT)

    return preexec


def _remove_stale_clusters() -> None:
    """Directories of runs killed before they could clean up (their servers died with them)."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "loraplex-pg-*")):
        with_pid = Path(path) / "data" / "postmaster.pid"
        try:
            if time.time() - os.stat(path).st_mtime < STALE_AFTER_S:
                continue
            if with_pid.exists():
                pid = int(with_pid.read_text().split()[0])
                if Path(f"/proc/{pid}").exists():
                    continue
        except (OSError, ValueError, IndexError):
            continue
        shutil.rmtree(path, ignore_errors=True)


@dataclass
class PostgresServer:
    bin_dir: Path
    root: Path  # holds data/, the socket and the log; owned by the user the server runs as
    port: int
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _databases: int = field(default=0, init=False)
    _template_ready: bool = field(default=False, init=False)

    @classmethod
    def start(cls) -> PostgresServer:
        reason = unavailable()
        if reason is not None:
            raise RuntimeError(reason)
        bin_dir = find_bin_dir()
        assert bin_dir is not None
        _remove_stale_clusters()
        # Not under pytest's tmp dir: that is private to root, and the server may run as postgres.
        root = Path(tempfile.mkdtemp(prefix="loraplex-pg-"))
        if os.geteuid() == 0:
            shutil.chown(root, "postgres", "postgres")
        server = cls(bin_dir, root, _free_port())
        try:
            server._initdb()
            server._serve()
        except BaseException:
            server.stop()
            raise
        atexit.register(server.stop)  # also when the session ends without its teardown
        return server

    def _initdb(self) -> None:
        result = subprocess.run(
            [
                str(self.bin_dir / "initdb"), "-D", str(self.root / "data"), "-U", "postgres",
                "-A", "trust", "-E", "UTF8", "--no-sync", "--no-instructions",
            ],
            cwd=self.root, capture_output=True, text=True, timeout=120, check=False,
            preexec_fn=_as_server_user(die_with_parent=False),
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"initdb failed ({result.returncode}): {result.stderr.strip()}")

    def _serve(self) -> None:
        log = open(self.root / "server.log", "wb")  # noqa: SIM115 - the server's own stdout
        self.process = subprocess.Popen(
            [
                str(self.bin_dir / "postgres"), "-D", str(self.root / "data"),
                "-p", str(self.port), "-c", "listen_addresses=127.0.0.1",
                "-c", f"unix_socket_directories={self.root}",
                "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
                "-c", "max_connections=200",
            ],
            cwd=self.root, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=_as_server_user(die_with_parent=True),
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"postgres exited at start: {self._log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    pass
                self._admin("SELECT 1")  # accepting connections, not just listening
                return
            except Exception:
                time.sleep(0.1)
        raise RuntimeError(f"postgres did not start within 60 s: {self._log_tail()}")

    def _log_tail(self) -> str:
        log = self.root / "server.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else ""

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def _admin(self, *statements: str) -> None:
        # CREATE/DROP DATABASE cannot run inside a transaction.
        engine = create_engine(self.url(), isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as connection:
                for statement in statements:
                    connection.execute(text(statement))
        finally:
            engine.dispose()

    def _ensure_template(self) -> None:
        if self._template_ready:
            return
        from loraplex.platform.db import migrate

        self._admin(f"CREATE DATABASE {TEMPLATE_DB}")
        migrate.upgrade(self.url(TEMPLATE_DB))  # disposes its engine: no session left open
        self._template_ready = True

    def create_database(self, *, migrated: bool = True) -> str:
        """A new database (at the newest schema unless ``migrated=False``); returns its URL."""
        self._databases += 1
        name = f"t{self._databases}_{uuid.uuid4().hex[:8]}"
        if migrated:
            self._ensure_template()
            self._admin(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE_DB}")
        else:
            self._admin(f"CREATE DATABASE {name}")
        return self.url(name)

    def drop_database(self, url: str) -> None:
        name = url.rsplit("/", 1)[1]
        self._admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # "fast" shutdown: disconnects clients
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.root, ignore_errors=True)
