"""Request-log rows written straight into a test platform's database (the admin UI's tests)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import insert

from loraplex.platform import tenants
from loraplex.platform.db.models import RequestLogEntry, utcnow
from tests.utils.web import WebEnv


def add_log_rows(web: WebEnv, tenant: str, n: int, *, status: int = 200, **extra: Any) -> None:
    """``n`` rows of ``tenant`` (created when missing), a minute apart, the newest a minute old;
    ``extra``: columns to set on every row (bodies, say)."""
    with web.store.db.session() as session:
        owner = tenants.get_tenant(session, tenant) or tenants.create_tenant(
            session, "admin", tenant, quotas=tenants.Quotas()
        )
        base = utcnow() - dt.timedelta(minutes=n)
        rows = [
            {"created_at": base + dt.timedelta(minutes=i), "tenant_id": owner.id,
             "key_id": "k1", "method": "POST", "endpoint": "/v1/chat/completions",
             "model": "pirate", "served_model": "pirate@1", "status": status,
             "error_code": None if status < 400 else "boom", "prompt_tokens": 5,
             "completion_tokens": 7, "ttft_ms": 3.0, "duration_ms": 9.0,
             "finish_reason": "stop", "request_id": f"{tenant}-{status}-{i}", "stream": False,
             **extra}
            for i in range(n)
        ]  # fmt: skip
        session.execute(insert(RequestLogEntry), rows)
