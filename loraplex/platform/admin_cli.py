"""``loraplex db ...`` and ``loraplex admin ...``: the schema, tenants, keys and the admin token,
from the shell, on the same database as the server (it may be running).

Settings come from ``LORAPLEX_*`` (``TenancySettings``); ``--database-url`` and ``--data-dir``
override them. A new key or admin token is printed alone on stdout (``KEY=$(loraplex admin key
create acme)``), once; notes go to stderr. Every change is audited with the actor ``admin (cli)``.
Failures print one line, ``loraplex: error: ...``, and exit 1. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from loraplex.argtypes import positive_float, positive_int
from loraplex.platform import admin_token, audit, tenants
from loraplex.platform.db import migrate
from loraplex.platform.db.database import Database
from loraplex.platform.db.models import utcnow
from loraplex.platform.db.scope import TenantScope
from loraplex.platform.errors import APIError
from loraplex.platform.keys import PREFIX, display_key
from loraplex.platform.model_access import describe
from loraplex.platform.settings import TenancySettings
from loraplex.platform.webhooks import cli as webhook_cli

CLI_ACTOR = "admin (cli)"


class CommandError(Exception):
    """A failure to report in one line (exit 1)."""


def _scopes(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def add_commands(commands: Any, parser_class: type[argparse.ArgumentParser]) -> None:
    """Register ``db`` and ``admin`` on the CLI's subcommands (an argparse subparsers action);
    nested subcommands use ``parser_class``."""
    common = argparse.ArgumentParser(add_help=False)
    where = common.add_argument_group("database")
    where.add_argument(
        "--database-url", default=None, metavar="URL",
        help="any SQLAlchemy URL (default: LORAPLEX_DATABASE_URL, or DATA_DIR/loraplex.db)",
    )  # fmt: skip
    where.add_argument(
        "--data-dir", type=Path, default=None, metavar="DIR",
        help="the platform's data directory (default: LORAPLEX_DATA_DIR)",
    )  # fmt: skip

    def group(parent: Any, name: str, help: str, dest: str) -> Any:
        p = parent.add_parser(name, help=help, description=help)
        sub = p.add_subparsers(dest=dest, metavar="COMMAND", parser_class=parser_class)
        sub.required = True
        return sub

    def leaf(parent: Any, name: str, help: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = parent.add_parser(
            name, help=help, description=help, parents=[common]
        )
        return p

    db = group(commands, "db", "the platform database's schema (Alembic migrations)", "db_command")
    p = leaf(db, "upgrade", "migrate the database to the newest schema (or to REVISION)")
    p.add_argument("revision", nargs="?", default="head", metavar="REVISION")
    p = leaf(db, "downgrade", "migrate the database down to REVISION ('base': drop every table)")
    p.add_argument("revision", metavar="REVISION")
    leaf(db, "current", "print the database's schema revision")

    admin = group(commands, "admin", "manage tenants, their API keys, the admin token", "admin_on")
    tenant = group(admin, "tenant", "tenants", "tenant_command")
    p = leaf(tenant, "create", "create a tenant")
    p.add_argument("name", metavar="NAME", help="lowercase letters, digits, '-', '_'")
    p.add_argument("--display-name", default="")
    p.add_argument("--rpm", type=positive_int, default=None, help="requests per minute")
    p.add_argument("--tpm", type=positive_int, default=None, help="tokens per minute")
    p.add_argument("--max-concurrent", type=positive_int, default=None, help="concurrent requests")
    p.add_argument("--max-adapters", type=positive_int, default=None, help="adapters it may own")
    _scheduling_arguments(p, 1.0, 0)
    p = leaf(tenant, "update", "change a tenant's limits, scheduling or status")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--display-name", default=None)
    p.add_argument("--status", choices=tenants.TENANT_STATUSES, default=None)
    for flag, help_ in _QUOTA_FLAGS.items():
        p.add_argument(flag, type=_limit_arg, default=argparse.SUPPRESS, metavar="N|none",
                       help=f"{help_} (none: unlimited)")  # fmt: skip
    _scheduling_arguments(p, None, None)
    leaf(tenant, "list", "list the tenants")

    key = group(admin, "key", "tenants' API keys", "key_command")
    p = leaf(key, "create", "create an API key for TENANT and print it (shown only this once)")
    p.add_argument("tenant", metavar="TENANT")
    p.add_argument("--name", default="", help="a label for the key")
    p.add_argument(
        "--scopes", type=_scopes, default=list(tenants.DEFAULT_KEY_SCOPES),
        help=f"comma-separated, from {','.join(tenants.TENANT_SCOPES)} (default: both)",
    )  # fmt: skip
    p.add_argument("--expires-in-days", type=positive_int, default=None, metavar="N")
    p.add_argument("--models", type=_scopes, default=None, metavar="M1,M2", help=_MODELS_HELP)
    p = leaf(key, "update", "rename a key or change the models it may use (from its next request)")
    p.add_argument("tenant", metavar="TENANT")
    p.add_argument("public_id", metavar="PUBLIC_ID", help="as listed (lpx_<id>…) or the id alone")
    p.add_argument("--name", default=None, help="a new label for the key")
    models = p.add_mutually_exclusive_group()
    models.add_argument("--models", type=_scopes, default=None, metavar="M1,M2", help=_MODELS_HELP)
    models.add_argument("--all-models", action="store_true", help="lift the key's model list")
    p = leaf(key, "list", "list TENANT's keys (never their secrets)")
    p.add_argument("tenant", metavar="TENANT")
    p = leaf(key, "revoke", "revoke a key: it is refused from the next request on")
    p.add_argument("tenant", metavar="TENANT")
    p.add_argument("public_id", metavar="PUBLIC_ID", help="as listed (lpx_<id>…) or the id alone")

    token = group(admin, "token", "the operator's admin token", "token_command")
    leaf(token, "rotate", "replace the admin token and print the new one (the old one stops)")
    webhook_cli.add_commands(group(admin, "webhook", "alert webhooks", "webhook_command"), leaf)


_MODELS_HELP = (
    "comma-separated: the only models the key may use (the base model's name, adapter names, "
    "name@N); others answer 404 as if missing (default: every model)"
)
_QUOTA_FLAGS = {  # flag: help, in QUOTA_FIELDS order
    "--rpm": "requests per minute",
    "--tpm": "tokens per minute",
    "--max-concurrent": "concurrent requests",
    "--max-adapters": "adapters it may own",
}
UNLIMITED = "none"


def _limit_arg(text: str) -> int | None:
    """A quota for ``tenant update``: a whole number of at least 1, or "none" (unlimited)."""
    return None if text.strip().lower() == UNLIMITED else positive_int(text)


def _scheduling_arguments(
    p: argparse.ArgumentParser, weight: float | None, prio: int | None
) -> None:
    p.add_argument(
        "--weight", type=positive_float, default=weight,
        help="its share of the engine when backlogged, under the fair policy (1 = equal)",
    )  # fmt: skip
    p.add_argument(
        "--max-priority", type=int, default=prio, metavar="P",
        help="the most urgent request priority it may send (lower runs earlier; 0 = none "
        "ahead of the default)",
    )  # fmt: skip


def settings_from(args: argparse.Namespace) -> TenancySettings:
    overrides = {"data_dir": args.data_dir, "database_url": args.database_url}
    return TenancySettings(**{k: v for k, v in overrides.items() if v is not None})


def shown_url(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)


def run(args: argparse.Namespace, out: Any = None, err: Any = None) -> int:
    """Run a ``db`` or ``admin`` command; 0 on success, 1 after printing one line on failure."""
    out = out or sys.stdout
    err = err or sys.stderr
    shown = ""
    try:
        settings = settings_from(args)
        url = settings.resolved_database_url
        shown = shown_url(url)
        if not (args.command == "db" and args.db_command in ("upgrade", "current")):
            _require_database(args, url)  # only 'db upgrade' creates a database
        if args.command == "db":
            _db(args, settings, out)
        else:
            _admin(args, settings, out, err)
            print(f"loraplex: database {shown}", file=err)
        return 0
    except CommandError as exc:
        message = str(exc)
    except APIError as exc:
        message = _cli_message(exc)
    except (migrate.MigrationError, admin_token.AdminTokenError, ValueError, OSError) as exc:
        message = str(exc)
    except SQLAlchemyError as exc:
        first = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        message = f"database error ({shown}): {first[0] if first else type(exc).__name__}"
    if shown and shown not in message:
        message += f" (database {shown})"
    print(f"loraplex: error: {' '.join(message.split())}", file=err)
    return 1


def _sqlite_file(url: str) -> Path | None:
    parsed = make_url(url)
    database = parsed.database
    if parsed.get_backend_name() != "sqlite" or not database or database == ":memory:":
        return None
    return None if database.startswith("file:") else Path(database)


def _require_database(args: argparse.Namespace, url: str) -> None:
    """A SQLite file that does not exist is not created here (only by 'db upgrade'): it is
    most likely the wrong data directory, and a new database there is one the server never
    reads."""
    path = _sqlite_file(url)
    if path is None or path.exists():
        return
    if args.database_url is not None:
        source = "--database-url"
    elif args.data_dir is not None:
        source = "--data-dir"
    elif os.environ.get("LORAPLEX_DATABASE_URL"):
        source = "LORAPLEX_DATABASE_URL"
    elif os.environ.get("LORAPLEX_DATA_DIR"):
        source = "LORAPLEX_DATA_DIR"
    else:
        source = "the default data directory"
    raise CommandError(
        f"there is no database at {path} (from {source}); pass the --data-dir or "
        "--database-url the server runs with (or set LORAPLEX_DATA_DIR / "
        "LORAPLEX_DATABASE_URL), or, to start a new database there, run 'loraplex db upgrade' "
        "with these settings"
    )


def _cli_message(exc: APIError) -> str:
    if exc.code == "tenant_not_found":
        return f"{exc.message.split(';')[0]}; 'loraplex admin tenant list' lists them"
    if exc.code == "key_not_found":
        return f"{exc.message.split(';')[0]}; 'loraplex admin key list TENANT' lists them"
    return exc.message


def _db(args: argparse.Namespace, settings: TenancySettings, out: Any) -> None:
    url = settings.resolved_database_url
    if args.db_command == "upgrade" and (
        args.data_dir is not None or settings.database_url is None
    ):
        settings.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = _sqlite_file(url)
    missing = path is not None and not path.exists()
    before = None if missing else migrate.current(url)  # reading creates no file
    if args.db_command == "current":
        newest = migrate.head()
        state = (
            "up to date" if before == newest else f"newest is {newest}; run 'loraplex db upgrade'"
        )
        if missing:
            state = f"no file yet; {state}"
        print(f"{before or 'none (empty database)'} ({state}) {shown_url(url)}", file=out)
        return
    if args.db_command == "upgrade":
        migrate.upgrade(url, args.revision)
    else:
        migrate.downgrade(url, args.revision)
    after = migrate.current(url)
    verb = "already at" if after == before else f"{args.db_command}d from {before or 'empty'} to"
    print(f"loraplex: {shown_url(url)}: {verb} {after or 'base (no tables)'}", file=out)


def _admin(args: argparse.Namespace, settings: TenancySettings, out: Any, err: Any) -> None:
    url = settings.resolved_database_url
    migrate.require_up_to_date(url)
    db = Database(url)
    try:
        handler = {
            ("tenant", "create"): _tenant_create,
            ("tenant", "update"): _tenant_update,
            ("tenant", "list"): _tenant_list,
            ("key", "create"): _key_create,
            ("key", "update"): _key_update,
            ("key", "list"): _key_list,
            ("key", "revoke"): _key_revoke,
            ("token", "rotate"): _token_rotate,
            **webhook_cli.HANDLERS,
        }[(args.admin_on, _sub(args))]
        handler(args, settings, db, out, err)
    finally:
        db.dispose()


def _sub(args: argparse.Namespace) -> str:
    return str(getattr(args, f"{args.admin_on}_command"))


def _tenant_create(
    args: argparse.Namespace, settings: TenancySettings, db: Database, out: Any, err: Any
) -> None:
    quotas = tenants.Quotas(
        requests_per_minute=args.rpm,
        tokens_per_minute=args.tpm,
        max_concurrent_requests=args.max_concurrent,
        max_adapters=args.max_adapters,
    )
    scheduling = tenants.Scheduling(weight=args.weight, max_priority=args.max_priority)
    tenant = db.call(
        lambda s: tenants.create_tenant(
            s, CLI_ACTOR, args.name, display_name=args.display_name, quotas=quotas,
            scheduling=scheduling,
        )
    )  # fmt: skip
    print(f"created tenant {tenant.name} ({_quota_text(tenant)})", file=out)
    if tenant.weight != tenants.Scheduling().weight:
        _weight_note(err)
    print(f"loraplex: next: loraplex admin key create {tenant.name}", file=err)


def _tenant_update(
    args: argparse.Namespace, settings: TenancySettings, db: Database, out: Any, err: Any
) -> None:
    dests = [flag[2:].replace("-", "_") for flag in _QUOTA_FLAGS]  # absent when not given
    quotas = {
        field: getattr(args, dest)
        for dest, field in zip(dests, tenants.QUOTA_FIELDS, strict=True)
        if hasattr(args, dest)
    }

    def update(session: Session) -> tuple[Any, bool]:
        tenant = tenants.require_tenant(session, args.name)
        before = audit.snapshot(tenant)
        tenants.update_tenant(
            session, CLI_ACTOR, tenant, display_name=args.display_name, status=args.status,
            quotas=quotas or None, weight=args.weight, max_priority=args.max_priority,
        )  # fmt: skip
        return tenant, audit.snapshot(tenant) != before

    tenant, changed = db.call(update)
    verb = "updated" if changed else "unchanged:"
    print(f"{verb} tenant {tenant.name} ({_quota_text(tenant)})", file=out)
    if args.weight is not None and changed:
        _weight_note(err)


def _weight_note(err: Any) -> None:
    """When a weight set here reaches the engine: this command only writes the database, which
    each running server re-reads every WEIGHT_REFRESH_S (``TenantService.refresh_weights_forever``)
    and hands to its engine for its next step; the admin API also pushes a change to its own
    server's engine at once (other replicas get it from the database)."""
    print(
        f"loraplex: running servers pick the new weight up within {tenants.WEIGHT_REFRESH_S:g} s "
        "(each re-reads the database that often; the admin API and console also push a change "
        "to their own server at once); only the fair scheduling policy, the default with "
        "tenants, uses it",
        file=err,
    )


def _limit(value: int | None) -> str:
    return "-" if value is None else str(value)


def _quota_text(tenant: Any) -> str:
    return (
        f"rpm {_limit(tenant.requests_per_minute)}, tpm {_limit(tenant.tokens_per_minute)}, "
        f"concurrent {_limit(tenant.max_concurrent_requests)}, "
        f"adapters {_limit(tenant.max_adapters)}; - = unlimited; weight {tenant.weight:g}, "
        f"max priority {tenant.max_priority}"
    )


def _table(rows: Sequence[Sequence[str]], out: Any) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip(), file=out)


def _day(value: dt.datetime | None) -> str:
    return "-" if value is None else value.strftime("%Y-%m-%d %H:%M")


def _tenant_list(
    args: argparse.Namespace, settings: TenancySettings, db: Database, out: Any, err: Any
) -> None:
    def fetch(session: Session) -> list[list[str]]:
        rows, _ = tenants.list_tenants(session, limit=10**6)
        return [
            [
                t.name,
                t.status,
                _limit(t.requests_per_minute),
                _limit(t.tokens_per_minute),
                _limit(t.max_concurrent_requests),
                _limit(t.max_adapters),
                f"{t.weight:g}",
                str(t.max_priority),
                str(len(tenants.list_keys(session, t))),
                _day(t.created_at),
                t.display_name,
            ]
            for t in rows
        ]

    rows = db.call(fetch)
    if not rows:
        print("no tenants yet; create one with: loraplex admin tenant create NAME", file=err)
        return
    header = [
        "NAME",
        "STATUS",
        "RPM",
        "TPM",
        "CONCURRENT",
        "ADAPTERS",
        "WEIGHT",
        "MAX_PRIO",
        "KEYS",
        "CREATED",
        "DISPLAY",
    ]
    _table([header, *rows], out)


def _key_create(
    args: argparse.Namespace, settings: TenancySettings, db: Database, out: Any, err: Any
) -> None:
    expires = utcnow() + dt.timedelta(days=args.expires_in_days) if args.expires_in_days else None

    def create(session: Session) -> tuple[str, str, list[str]]:
        tenant = tenants.require_tenant(session, args.tenant)
        key, new = tenants.create_key(
            session, CLI_ACTOR, tenant, name=args.name, scopes=args.scopes, expires_at=expires,
            allowed_models=args.models,
        )  # fmt: skip
        return new.token, display_key(key.public_id, key.last4), list(key.scopes)

    token, shown, scopes = db.call(create)
    print(token, file=out, flush=True)
    print(
        f"loraplex: created key {shown} for tenant {args.tenant} (scopes {', '.join(scopes)}; "
        f"models {describe(args.models)}; expires {_day(expires) + ' UTC' if expires else 'never'}"
        "); the key above is shown only this once, store it now",
        file=err,
    )


def _key_update(
    args: argparse.Namespace, settings: TenancySettings, db: Database, out: Any, err: Any
) -> None:
    if args.name is None and args.models is None and not args.all_models:
        raise APIError(
            400, "Nothing to change: give --name, --models M1,M2 or --all-models.", param="key"
        )
    public_id = public_id_of(args.public_id)
    models: list[str] | tenants.Unchanged | None = tenants.UNCHANGED
    if args.all_models:
        models = None
    elif args.models is not None:
        models = args.models

    def update(session: Session) -> tuple[str, list[str] | None]:
        tenant = tenants.require_tenant(session, args.tenant)
        key = tenants.update_key(
            session, CLI_ACTOR, tenant, public_id, name=args.name, allowed_models=models
        )
        return display_key(key.public_id, key.last4), key.allowed_models

    shown, allowed = db.call(update)
    print(
        f"key {shown} of tenant {args.tenant}: models {describe(allowed)}, from its next request",
        file=out,
    )


def _key_list(
    args: argparse.Namespace, settings: TenancySettings, db: Database, out: Any, err: Any
) -> None:
    now = utcnow()

    def fetch(session: Session) -> list[list[str]]:
        tenant = tenants.require_tenant(session, args.tenant)
        rows = []
        for k in tenants.list_keys(session, tenant):
            status = "revoked" if k.revoked_at else "active" if k.usable_at(now) else "expired"
            rows.append(
                [
                    display_key(k.public_id, k.last4),
                    k.public_id,
                    status,
                    ",".join(k.scopes),
                    _day(k.created_at),
                    _day(k.last_used_at),
                    _day(k.expires_at),
                    "all" if k.allowed_models is None else ",".join(k.allowed_models),
                    k.name,
                ]
            )
        return rows

    rows = db.call(fetch)
    if not rows:
        print(
            f"tenant {args.tenant} has no keys; loraplex admin key create {args.tenant}", file=err
        )
        return
    header = ["KEY", "PUBLIC_ID", "STATUS", "SCOPES", "CREATED", "LAST_USED", "EXPIRES", "MODELS",
              "NAME"]  # fmt: skip
    _table([header, *rows], out)


def public_id_of(text: str) -> str:
    """The public id in ``text``: the id alone, ``lpx_<id>…last4`` as listed, or a whole key."""
    text = text.strip()
    if text.startswith(PREFIX):
        text = text[len(PREFIX) :]
    for separator in ("…", "...", "_"):
        text = text.split(separator, 1)[0]
    return text


def _key_revoke(
    args: argparse.Namespace, settings: TenancySettings, db: Database, out: Any, err: Any
) -> None:
    public_id = public_id_of(args.public_id)

    def revoke(session: Session) -> tuple[str, bool]:
        tenant = tenants.require_tenant(session, args.tenant)
        existing = TenantScope(session, tenant.id).key(public_id)
        already = existing is not None and existing.revoked_at is not None
        key = tenants.revoke_key(session, CLI_ACTOR, tenant, public_id)
        return display_key(key.public_id, key.last4), already

    shown, already = db.call(revoke)
    state = "was already revoked" if already else "revoked; it is refused from the next request on"
    print(f"key {shown} of tenant {args.tenant} {state}", file=out)


def _token_rotate(
    args: argparse.Namespace, settings: TenancySettings, db: Database, out: Any, err: Any
) -> None:
    token = db.call(lambda s: admin_token.rotate(s, settings, CLI_ACTOR))
    print(token, file=out, flush=True)
    print(
        "loraplex: the new admin token is above (shown only this once; only its SHA-256 is "
        "stored); the old one is refused from the next request on, also by a running server",
        file=err,
    )
