"""``loraplex admin webhook ...``: alert webhooks from the shell, on the server's database.

    create URL --events E1,E2 [--description TEXT]   prints the signing secret alone, once
    list                                             never the secrets
    delete ID
    test ID                                          queues a webhook.test delivery: a running
                                                     server's worker sends it within seconds
    deliveries [--webhook ID] [--limit N]            recent ones, newest first, with outcomes

Every change is audited with the CLI's actor, as the admin API's are.
"""

from __future__ import annotations

import argparse
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy.orm import Session

from loraplex.argtypes import positive_int
from loraplex.platform.db.database import Database
from loraplex.platform.webhooks import store

CLI_ACTOR = "admin (cli)"  # as loraplex.platform.admin_cli
Leaf = Callable[[Any, str, str], argparse.ArgumentParser]
Handler = Callable[[argparse.Namespace, Any, Database, Any, Any], None]


def _events(text: str) -> list[str]:
    return [e.strip() for e in text.split(",") if e.strip()]


def add_commands(group: Any, leaf: Leaf) -> None:
    """The ``webhook`` subcommands, on ``group`` (``leaf`` adds one with the database options)."""
    p = leaf(group, "create", "subscribe URL to alerts and print its signing secret (once)")
    p.add_argument("url", metavar="URL", help="http:// or https://; redirects are not followed")
    p.add_argument("--events", type=_events, required=True, metavar="E1,E2",
                   help="comma-separated, from: " + ", ".join(store.EVENT_TYPES))  # fmt: skip
    p.add_argument("--description", default="")
    leaf(group, "list", "list the webhooks (never their secrets)")
    p = leaf(group, "delete", "delete a webhook and its deliveries")
    p.add_argument("webhook_id", type=positive_int, metavar="ID")
    p = leaf(group, "test", "queue a webhook.test delivery (a running server sends it)")
    p.add_argument("webhook_id", type=positive_int, metavar="ID")
    p = leaf(group, "deliveries", "recent deliveries, newest first, with their outcome")
    p.add_argument("--webhook", type=positive_int, default=None, metavar="ID")
    p.add_argument("--limit", type=positive_int, default=20, metavar="N")


def _table(rows: Sequence[Sequence[str]], out: Any) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip(), file=out)


def _create(args: argparse.Namespace, settings: Any, db: Database, out: Any, err: Any) -> None:
    view, secret = db.call(
        lambda s: store.create_webhook(s, CLI_ACTOR, args.url, args.events, args.description)
    )
    print(secret, file=out, flush=True)
    print(f"loraplex: created webhook {view.id} -> {view.url} ({', '.join(view.events)}); the "
          "secret above is shown only this once", file=err)  # fmt: skip


def _list(args: argparse.Namespace, settings: Any, db: Database, out: Any, err: Any) -> None:
    views = db.call(store.list_webhooks)
    if not views:
        print("no webhooks yet; add one with: loraplex admin webhook create URL --events ...",
              file=err)  # fmt: skip
        return
    rows = [[str(v.id), v.url, ",".join(v.events), v.created_at.strftime("%Y-%m-%d %H:%M"),
             v.description] for v in views]  # fmt: skip
    _table([["ID", "URL", "EVENTS", "CREATED", "DESCRIPTION"], *rows], out)


def _delete(args: argparse.Namespace, settings: Any, db: Database, out: Any, err: Any) -> None:
    view = db.call(lambda s: store.delete_webhook(s, CLI_ACTOR, args.webhook_id))
    print(f"loraplex: deleted webhook {view.id} ({view.url})", file=err)


def _test(args: argparse.Namespace, settings: Any, db: Database, out: Any, err: Any) -> None:
    nonce = secrets.token_hex(8)

    def write(session: Session) -> str | None:
        store.require_webhook(session, args.webhook_id)
        data = {"message": "A test delivery from loraplex.", "webhook_id": args.webhook_id}
        return store.record_event(session, store.TEST_EVENT, f"webhook.test:{nonce}", data,
                                  time.time(), only_webhook=args.webhook_id)  # fmt: skip

    print(db.call(write), file=out)
    print("loraplex: queued; 'loraplex admin webhook deliveries' shows its outcome once a "
          "running server has sent it", file=err)  # fmt: skip


def _deliveries(args: argparse.Namespace, settings: Any, db: Database, out: Any, err: Any) -> None:
    views = db.call(lambda s: store.deliveries(s, webhook_id=args.webhook, limit=args.limit))
    if not views:
        print("no deliveries yet", file=err)
        return
    rows = [[str(d.id), str(d.webhook_id), d.kind, d.event_id, d.state, str(d.attempts),
             str(d.last_status or "-"), (d.last_error or "")[:80]] for d in views]  # fmt: skip
    _table([["ID", "WEBHOOK", "EVENT", "EVENT_ID", "STATE", "ATTEMPTS", "HTTP", "LAST_ERROR"],
            *rows], out)  # fmt: skip


HANDLERS: dict[tuple[str, str], Handler] = {
    ("webhook", "create"): _create,
    ("webhook", "list"): _list,
    ("webhook", "delete"): _delete,
    ("webhook", "test"): _test,
    ("webhook", "deliveries"): _deliveries,
}
