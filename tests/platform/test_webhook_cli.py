"""``loraplex admin webhook ...``: create prints the secret alone (once), list never shows it, a
bad URL or event is one error line, test queues a delivery that a running server's worker
sends to a real receiver (listed by ``deliveries``), delete removes it; all audited as the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from loraplex.cli import main
from loraplex.platform.db.database import sqlite_url
from loraplex.platform.db.models import AuditEvent
from loraplex.platform.webhooks.cli import CLI_ACTOR
from tests.utils.fakes import FakeEngineClient
from tests.utils.tenancy import tenancy_env
from tests.utils.webhook_receiver import Receiver

pytestmark = pytest.mark.anyio


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


async def test_webhooks_from_the_shell(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake: FakeEngineClient, tokenizer: Any
) -> None:
    async with tenancy_env(tmp_path, fake, tokenizer) as env:
        url = ("--database-url", sqlite_url(tmp_path / "data" / "loraplex.db"))
        code, _, err = _cli(capsys, "admin", "webhook", "create", "ftp://x/", "--events",
                            "key.expiring", *url)  # fmt: skip
        assert code == 1 and err.count("\n") == 1 and "Only http:// and https://" in err
        code, _, err = _cli(capsys, "admin", "webhook", "create", "http://x.example/",
                            "--events", "key.expiring,nope", *url)  # fmt: skip
        assert code == 1 and "Unknown event 'nope'" in err
        with Receiver() as receiver:
            code, out, err = _cli(capsys, "admin", "webhook", "create", receiver.url,
                                  "--events", "key.expiring", *url)  # fmt: skip
            assert code == 0 and out.startswith("whsec_") and "created webhook 1" in err
            secret = out.strip()
            code, out, _ = _cli(capsys, "admin", "webhook", "list", *url)
            assert code == 0 and receiver.url in out and secret not in out
            code, out, _ = _cli(capsys, "admin", "webhook", "test", "1", *url)
            assert code == 0 and out.startswith("evt_")
            event_id = out.strip()
            async with env.app.platform.lifespan(own_client=False):  # the server's worker
                (got,) = await receiver.wait_for(1)
            assert got.headers["X-Loraplex-Event-Id"] == event_id
        code, out, _ = _cli(capsys, "admin", "webhook", "deliveries", *url)
        assert code == 0 and event_id in out and "succeeded" in out
        code, _, err = _cli(capsys, "admin", "webhook", "delete", "1", *url)
        assert code == 0 and "deleted webhook 1" in err
        code, _, err = _cli(capsys, "admin", "webhook", "delete", "1", *url)
        assert code == 1 and "There is no webhook 1" in err
        with env.store.db.session() as session:
            events = session.scalars(select(AuditEvent).where(AuditEvent.action.like("webhook.%")))
            assert [(e.action, e.actor) for e in events] == [
                ("webhook.create", CLI_ACTOR),
                ("webhook.delete", CLI_ACTOR),
            ]
