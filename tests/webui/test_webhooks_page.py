"""The Webhooks page: a webhook added through the form shows its signing secret once (never
again, never in the list), a bad URL or no events comes back inline, a test-send reaches a real
receiver and its delivery is listed with its outcome, delete removes it; the audit log names
the admin UI."""

from __future__ import annotations

import asyncio
import re
import time

import pytest
from sqlalchemy import select

from loraplex.platform.db.models import AuditEvent
from loraplex.webui.views import WEB_ACTOR
from tests.utils.web import WebEnv, post_form, sign_in
from tests.utils.webhook_receiver import Receiver

pytestmark = pytest.mark.anyio
PAGE = "/admin/webhooks"


async def test_add_see_the_secret_once_test_send_and_delete(web: WebEnv) -> None:
    with Receiver() as receiver:
        async with web.http() as http, web.app.platform.lifespan(own_client=False):
            await sign_in(http)
            bad = await post_form(http, PAGE, PAGE, {"url": "ftp://x.example/", "events": []})
            assert bad.status_code == 400
            assert "Only http:// and https:// URLs" not in bad.text  # no events: said first
            assert "Tick at least one event" in bad.text
            bad = await post_form(http, PAGE, PAGE,
                                  {"url": "ftp://x.example/", "events": ["key.expiring"]})  # fmt: skip
            assert bad.status_code == 400 and "Only http:// and https:// URLs" in bad.text
            added = await post_form(
                http, PAGE, PAGE,
                {"url": receiver.url, "events": ["key.expiring", "engine.restarted"],
                 "description": "pager"},
            )  # fmt: skip
            assert added.status_code == 303, added.text
            shown = await http.get(added.headers["location"])
            secret = re.search(r'id="new-secret"[^>]*>(whsec_[^<]+)<', shown.text)
            assert secret, shown.text
            again = await http.get(added.headers["location"])
            assert secret.group(1) not in again.text and "whsec_" not in again.text
            assert receiver.url in again.text and "key.expiring, engine.restarted" in again.text
            hook_id = re.search(r"/admin/webhooks/(\d+)/test", again.text)
            assert hook_id
            sent = await post_form(http, PAGE, f"{PAGE}/{hook_id.group(1)}/test", {})
            assert sent.status_code == 303
            (got,) = await receiver.wait_for(1)
            assert got.headers["X-Loraplex-Event-Type"] == "webhook.test"
            deadline = time.monotonic() + 5
            while 'badge-ok">succeeded' not in (listed := (await http.get(PAGE)).text):
                assert time.monotonic() < deadline, listed
                await asyncio.sleep(0.05)
            assert "webhook.test" in listed and ">200<" in listed
            gone = await post_form(http, PAGE, f"{PAGE}/{hook_id.group(1)}/delete", {})
            assert gone.status_code == 303
            after = (await http.get(PAGE)).text
            assert receiver.url not in after and "No webhooks yet" in after
    with web.store.db.session() as session:
        events = session.scalars(select(AuditEvent).where(AuditEvent.action.like("webhook.%")))
        assert [(e.action, e.actor) for e in events] == [
            ("webhook.create", WEB_ACTOR),
            ("webhook.delete", WEB_ACTOR),
        ]
