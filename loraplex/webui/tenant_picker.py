"""The tenant field of the forms that act for a tenant (new key, adapter upload, playground), and
the tenants' names as the Overview's share chart labels them.

The field is a ``<select>`` of the tenants the signed-in user may act for: an operator acts for
every tenant, a viewer for none (it changes nothing; its forms are hidden and their posts
refused, see ``context.require_writer``). A select lists everything, so it is used while there
are at most ``PICKER_LIMIT`` tenants; past that (a platform with thousands of tenants) the field
is a text input with the first ``PICKER_LIMIT`` names as suggestions. Either way the server checks
the posted name as before: the picker only saves typing and typos.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.platform.db.models import Tenant

PICKER_LIMIT = 200  # tenants a <select> lists; more: a text field with suggestions


@dataclass(frozen=True)
class TenantChoice:
    name: str
    suspended: bool

    @property
    def label(self) -> str:
        return f"{self.name} (suspended)" if self.suspended else self.name


@dataclass(frozen=True)
class TenantPicker:
    """What a form's tenant field offers. ``complete``: every tenant the user may act for is in
    ``choices`` (a ``<select>``); else ``choices`` are the first by name (suggestions)."""

    choices: tuple[TenantChoice, ...]
    complete: bool

    def options(self, current: str) -> tuple[TenantChoice, ...]:
        """The choices, with ``current`` (a name from the URL or a refused post) kept first when
        it is none of them, so the form shows what was asked and the server says what is wrong."""
        if not current or any(c.name == current for c in self.choices):
            return self.choices
        return (TenantChoice(current, False), *self.choices)


NO_CHOICE = TenantPicker(choices=(), complete=True)


def tenant_picker(session: Session, *, may_act: bool, limit: int | None = None) -> TenantPicker:
    """The tenants a form offers: every tenant by name for an operator (``may_act``), none for a
    viewer; ``limit`` (default ``PICKER_LIMIT``) the most a select lists."""
    if not may_act:
        return NO_CHOICE
    limit = PICKER_LIMIT if limit is None else limit
    rows = session.execute(
        select(Tenant.name, Tenant.status).order_by(Tenant.name).limit(limit + 1)
    ).all()
    choices = tuple(TenantChoice(name, status == "suspended") for name, status in rows[:limit])
    return TenantPicker(choices=choices, complete=len(rows) <= limit)


def tenant_labels(session: Session, ids: Iterable[str]) -> dict[str, str]:
    """The tenants with these ids (``str(tenant.id)``, as the engine knows them) as a chart's
    legend names them: the name, marked when suspended. An id of no tenant (a deleted one, ``-``
    for the operator) is left out."""
    wanted = [int(i) for i in ids if i.isascii() and i.isdigit()]
    if not wanted:
        return {}
    rows = session.execute(
        select(Tenant.id, Tenant.name, Tenant.status).where(Tenant.id.in_(wanted))
    )
    return {
        str(tid): f"{name} (suspended)" if status == "suspended" else name
        for tid, name, status in rows
    }
