"""``loraplex db`` and ``loraplex admin``: schema, tenants, keys, the admin token, from the shell."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from sqlalchemy import select

from loraplex.cli import main
from loraplex.platform import admin_token, tenants
from loraplex.platform.db import migrate
from loraplex.platform.db.database import Database
from loraplex.platform.db.models import ApiKey, AuditEvent, PlatformSetting, Tenant
from loraplex.platform.keys import hash_secret, parse_key
from tests.utils.tenancy import TenancyEnv, bearer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("LORAPLEX_DATABASE_URL", "LORAPLEX_ADMIN_TOKEN", "LORAPLEX_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path / "data"))


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("loraplex: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_schema_tenants_keys_and_token_from_the_shell(
    capsys: pytest.CaptureFixture[str], empty_database_url: str
) -> None:
    url = ("--database-url", empty_database_url)
    code, out, _ = cli(capsys, "db", "current", *url)
    assert code == 0 and out.startswith("none (empty database)")
    code, _, err = cli(capsys, "admin", "tenant", "list", *url)
    assert code == 1 and "loraplex db upgrade" in one_error_line(err)

    code, out, _ = cli(capsys, "db", "upgrade", *url)
    assert code == 0 and f"from empty to {migrate.head()}" in out
    assert migrate.current(empty_database_url) == migrate.head()
    code, out, _ = cli(capsys, "db", "current", *url)
    assert out.startswith(f"{migrate.head()} (up to date)")

    code, out, _ = cli(
        capsys, "admin", "tenant", "create", "acme", "--display-name", "Acme Corp",
        "--rpm", "60", "--tpm", "5000", "--max-concurrent", "4", "--max-adapters", "3", *url,
    )  # fmt: skip
    assert code == 0 and "created tenant acme" in out
    code, out, _ = cli(capsys, "admin", "tenant", "list", *url)
    assert code == 0
    # name, status, rpm, tpm, concurrent, adapters, weight, max priority, keys
    assert out.splitlines()[1].split()[:9] == [
        "acme", "active", "60", "5000", "4", "3", "1", "0", "0"
    ]  # fmt: skip

    code, out, err = cli(
        capsys, "admin", "key", "create", "acme", "--name", "ci", "--scopes", "inference",
        "--expires-in-days", "30", *url,
    )  # fmt: skip
    assert code == 0
    token = out.strip()
    assert out == token + "\n"  # the key alone on stdout
    parsed = parse_key(token)
    assert parsed is not None
    public_id, secret = parsed
    assert "shown only this once" in err and secret not in err

    code, out, _ = cli(capsys, "admin", "key", "list", "acme", *url)
    assert code == 0 and secret not in out
    row = out.splitlines()[1].split()
    assert row[1:4] == [public_id, "active", "inference"] and row[0].endswith(secret[-4:])

    code, out, _ = cli(capsys, "admin", "key", "revoke", "acme", row[0], *url)  # as listed
    assert code == 0 and "revoked" in out
    code, out, _ = cli(capsys, "admin", "key", "list", "acme", *url)
    assert out.splitlines()[1].split()[2] == "revoked"

    code, out, err = cli(capsys, "admin", "token", "rotate", *url)
    assert code == 0
    new_admin = out.strip()
    assert new_admin.startswith(admin_token.TOKEN_PREFIX) and new_admin not in err

    db = Database(empty_database_url)
    try:
        with db.session() as session:
            tenant = session.scalars(select(Tenant)).one()
            assert (tenant.display_name, tenant.requests_per_minute, tenant.max_adapters) == (
                "Acme Corp", 60, 3,
            )  # fmt: skip
            key = session.scalars(select(ApiKey)).one()
            assert key.secret_sha256 == hash_secret(secret) and key.revoked_at is not None
            assert key.expires_at is not None
            setting = session.get(PlatformSetting, admin_token.SETTING_KEY)
            assert setting is not None
            assert setting.value == admin_token.token_sha256(new_admin)
            audit = [(e.actor, e.action) for e in session.scalars(select(AuditEvent))]
            assert audit == [
                ("admin (cli)", "tenant.create"),
                ("admin (cli)", "key.create"),
                ("admin (cli)", "key.revoke"),
                ("admin (cli)", "admin_token.rotate"),
            ]
            every_value = json.dumps(
                [[e.before, e.after] for e in session.scalars(select(AuditEvent))]
            )
            assert secret not in every_value and new_admin not in every_value
    finally:
        db.dispose()

    code, out, _ = cli(capsys, "db", "downgrade", "base", *url)
    assert code == 0 and "base (no tables)" in out
    assert migrate.current(empty_database_url) is None


@pytest.mark.anyio
async def test_a_key_made_by_the_cli_works_on_the_running_server(
    tenancy: TenancyEnv, capsys: pytest.CaptureFixture[str]
) -> None:
    url = ("--database-url", tenancy.store.db.url)
    assert cli(capsys, "admin", "tenant", "create", "acme", *url)[0] == 0
    _, out, _ = cli(capsys, "admin", "key", "create", "acme", *url)
    token = out.strip()
    assert (await tenancy.http.get("/v1/models", headers=bearer(token))).status_code == 200
    public_id = (parse_key(token) or ("", ""))[0]
    assert cli(capsys, "admin", "key", "revoke", "acme", public_id, *url)[0] == 0
    assert (await tenancy.http.get("/v1/models", headers=bearer(token))).status_code == 401


def test_the_data_dir_comes_from_the_environment_or_the_flag(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert cli(capsys, "db", "upgrade")[0] == 0
    assert (tmp_path / "data" / "loraplex.db").exists()
    other = tmp_path / "other"
    assert cli(capsys, "db", "upgrade", "--data-dir", str(other))[0] == 0
    assert (other / "loraplex.db").exists()
    assert cli(capsys, "admin", "tenant", "create", "acme", "--data-dir", str(other))[0] == 0
    _, out, err = cli(capsys, "admin", "tenant", "list")  # the env's database: no tenants
    assert out == "" and "no tenants yet" in err


def test_a_command_on_a_missing_database_names_it_and_creates_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The server runs on another data dir; the admin forgot --data-dir. Nothing is created
    where the server does not look, and the one line says which database was meant."""
    server_dir = tmp_path / "server-data"
    assert cli(capsys, "db", "upgrade", "--data-dir", str(server_dir))[0] == 0
    default = tmp_path / "data"  # LORAPLEX_DATA_DIR of this test
    for args in (
        ["admin", "tenant", "create", "acme"],
        ["admin", "tenant", "list"],
        ["admin", "key", "create", "acme"],
        ["admin", "token", "rotate"],
        ["db", "downgrade", "base"],
    ):
        code, out, err = cli(capsys, *args)
        line = one_error_line(err)
        assert code == 1 and out == "", (args, out)
        assert str(default / "loraplex.db") in line and "LORAPLEX_DATA_DIR" in line, line
        assert "--data-dir" in line and "db upgrade" in line, line
        assert not default.exists(), f"{args} created {default}"
    code, out, _ = cli(capsys, "db", "current")  # reads, creates nothing
    assert code == 0 and str(default / "loraplex.db") in out and "no file yet" in out
    assert not default.exists()
    code, out, err = cli(capsys, "admin", "tenant", "create", "acme", "--data-dir", str(server_dir))
    assert code == 0 and f"database sqlite:///{server_dir / 'loraplex.db'}" in err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["admin", "tenant", "create", "acme"], "already exists"),
        (["admin", "tenant", "create", "Bad/Name"], "tenant name is"),
        (["admin", "key", "create", "nobody"], "No tenant named 'nobody'"),
        (["admin", "key", "create", "acme", "--scopes", "admin"], "'admin' is not one"),
        (["admin", "key", "revoke", "acme", "nosuchkey"], "admin key list"),
        (["db", "downgrade", "7777"], "no schema revision '7777'"),
        (["db", "upgrade", "--database-url", "nonsense://x"], "database error (nonsense://x)"),
    ],
)
def test_failures_are_one_line_and_exit_1(
    capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    assert cli(capsys, "db", "upgrade")[0] == 0
    assert cli(capsys, "admin", "tenant", "create", "acme")[0] == 0
    code, out, err = cli(capsys, *args)
    assert code == 1, (out, err)
    assert says in one_error_line(err)


def test_rotate_is_refused_while_the_token_comes_from_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cli(capsys, "db", "upgrade")[0] == 0
    monkeypatch.setenv("LORAPLEX_ADMIN_TOKEN", "an-operator-chosen-token-0123456789")
    code, out, err = cli(capsys, "admin", "token", "rotate")
    assert code == 1 and out == ""
    assert "LORAPLEX_ADMIN_TOKEN" in one_error_line(err)


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "admin", "tenant", "create", "acme", "--rpm", "0")
    assert code == 2 and "at least 1" in one_error_line(err)
    code, _, err = cli(capsys, "admin", "key")
    assert code == 2


def test_the_commands_never_import_torch(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        from loraplex.cli import main
        data = ["--data-dir", {str(tmp_path / "d")!r}]
        codes = [
            main(["db", "upgrade", *data]),
            main(["admin", "tenant", "create", "acme", *data]),
            main(["admin", "key", "create", "acme", *data]),
            main(["admin", "key", "list", "acme", *data]),
            main(["admin", "tenant", "list", *data]),
            main(["db", "current", *data]),
        ]
        heavy = sorted(m for m in ("torch", "transformers", "triton") if m in sys.modules)
        print("RESULT", codes, heavy, file=sys.stderr)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    assert "RESULT [0, 0, 0, 0, 0, 0] []" in result.stderr, result.stderr


def test_tenant_scheduling_and_limits_from_the_shell(
    capsys: pytest.CaptureFixture[str], empty_database_url: str
) -> None:
    url = ("--database-url", empty_database_url)
    assert cli(capsys, "db", "upgrade", *url)[0] == 0
    code, out, err = cli(capsys, "admin", "tenant", "create", "acme", "--weight", "2.5",
                         "--max-priority", "-3", "--rpm", "60", *url)  # fmt: skip
    assert code == 0 and "weight 2.5, max priority -3" in out
    # When a running server uses it (issue 35): the CLI only writes the database, which the
    # servers re-read every WEIGHT_REFRESH_S (test_tenant_scheduling runs that path).
    note = f"running servers pick the new weight up within {tenants.WEIGHT_REFRESH_S:g} s"
    assert note in err and "push a change to their own server at once" in err
    assert "only the fair scheduling policy" in err

    code, out, err = cli(capsys, "admin", "tenant", "update", "acme", "--weight", "3",
                         "--rpm", "none", "--tpm", "900", *url)  # fmt: skip
    assert code == 0 and out.startswith("updated tenant acme"), out
    assert "rpm -, tpm 900" in out and "weight 3," in out and "max priority -3" in out
    assert note in err
    code, out, _ = cli(capsys, "admin", "tenant", "update", "acme", "--weight", "3", *url)
    assert code == 0 and out.startswith("unchanged: tenant acme")
    code, out, _ = cli(capsys, "admin", "tenant", "list", *url)
    assert out.splitlines()[1].split()[:8] == ["acme", "active", "-", "900", "-", "-", "3", "-3"]

    for args, needle in (
        (("--weight", "0"), "must be more than 0"),
        (("--weight", "abc"), "expected a number"),
        (("--weight", "5000"), "from 0.01 to 100"),
        (("--weight", "5e-324"), "from 0.01 to 100"),
        (("--max-priority", "-5000"), "from -1000 to 1000"),
        (("--rpm", "0"), "at least 1"),
    ):
        code, _, err = cli(capsys, "admin", "tenant", "update", "acme", *args, *url)
        assert code != 0 and needle in err, (args, err)
    code, _, err = cli(capsys, "admin", "tenant", "update", "nobody", "--weight", "2", *url)
    assert code == 1 and "'loraplex admin tenant list' lists them" in one_error_line(err)

    db = Database(empty_database_url)
    try:
        with db.session() as session:
            tenant = session.scalars(select(Tenant)).one()
            assert (tenant.weight, tenant.max_priority) == (3.0, -3)
            assert (tenant.requests_per_minute, tenant.tokens_per_minute) == (None, 900)
            actions = [e.action for e in session.scalars(select(AuditEvent))]
            assert actions == ["tenant.create", "tenant.update"]  # the no-op wrote nothing
    finally:
        db.dispose()


def test_key_model_lists_from_the_shell(
    capsys: pytest.CaptureFixture[str], empty_database_url: str
) -> None:
    """Issue 34.3: ``--models`` on create, ``key update --models / --all-models``, listed; on
    SQLite and PostgreSQL (the column comes from migration 0004)."""
    url = ("--database-url", empty_database_url)
    assert cli(capsys, "db", "upgrade", *url)[0] == 0
    assert cli(capsys, "admin", "tenant", "create", "acme", *url)[0] == 0
    code, out, err = cli(capsys, "admin", "key", "create", "acme", "--models", "pirate, caps@1",
                         *url)  # fmt: skip
    assert code == 0 and "models pirate, caps@1" in err
    public_id = parse_key(out.strip())[0]  # type: ignore[index]
    code, out, _ = cli(capsys, "admin", "key", "list", "acme", *url)
    assert out.split()[7] == "MODELS" and out.splitlines()[1].split()[-1] == "pirate,caps@1"

    code, out, _ = cli(capsys, "admin", "key", "update", "acme", public_id, "--models", "caps",
                       *url)  # fmt: skip
    assert code == 0 and "models caps, from its next request" in out
    code, out, _ = cli(capsys, "admin", "key", "update", "acme", public_id, "--all-models", *url)
    assert code == 0 and "models all models" in out
    code, out, _ = cli(capsys, "admin", "key", "list", "acme", *url)
    assert out.splitlines()[1].split()[-1] == "all"  # the key has no name: models come last
    db = Database(empty_database_url)
    try:
        with db.session() as session:
            key = session.scalars(select(ApiKey)).one()
            assert key.allowed_models is None
            events = session.scalars(
                select(AuditEvent).where(AuditEvent.action == "key.update").order_by(AuditEvent.id)
            ).all()
            assert [e.after["allowed_models"] for e in events if e.after] == [["caps"], None]
    finally:
        db.dispose()

    code, _, err = cli(capsys, "admin", "key", "update", "acme", public_id, *url)
    assert code == 1 and "--models M1,M2 or --all-models" in one_error_line(err)
    code, _, err = cli(capsys, "admin", "key", "update", "acme", public_id, "--models", ",", *url)
    assert code == 1 and "list at least one model" in one_error_line(err)
