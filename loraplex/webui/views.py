"""What the tenant, key and audit pages share: the audit actor, how values are shown, form
parsing with messages for people, offset pagination, and the "not found" page.

Templates get display strings prepared here (the template environment has no custom filters),
so a page's Python decides every format once and the templates only lay them out.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from loraplex.config import PRIORITY_RANGE
from loraplex.platform.errors import APIError
from loraplex.platform.tenants import MAX_WEIGHT, MIN_WEIGHT
from loraplex.webui.context import Refused

WEB_ACTOR = "admin (web)"  # the audit log's actor for changes made in the admin UI

# One label per quota field of ``loraplex.platform.tenants.QUOTA_FIELDS``, in that order.
QUOTA_LABELS: dict[str, str] = {
    "requests_per_minute": "Requests per minute",
    "tokens_per_minute": "Tokens per minute",
    "max_concurrent_requests": "Concurrent requests",
    "max_adapters": "Adapters",
}

MAX_QUOTA = 10**12
MAX_PAGE_NUMBER = 9_999_999  # ?page= (an offset of at most 5e8 rows: inside any database)
NONE = "—"


# ---- showing values --------------------------------------------------------------------------


def fmt_time(value: dt.datetime | None) -> str:
    """``2025-01-31 12:00 UTC`` (the UI shows UTC everywhere: the log and usage days are UTC)."""
    if value is None:
        return NONE
    return value.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def fmt_iso(value: dt.datetime | None) -> str:
    """For ``<time datetime=...>``."""
    return "" if value is None else value.astimezone(dt.timezone.utc).isoformat(timespec="seconds")


def fmt_ago(value: dt.datetime | None, now: dt.datetime, never: str = "never") -> str:
    """``just now``, ``5 min ago``, ``3 h ago``, ``12 days ago``; future times ``in 3 days``."""
    if value is None:
        return never
    seconds = (now - value).total_seconds()
    future = seconds < 0
    seconds = abs(seconds)
    if seconds < 60:
        return "just now" if not future else "in under a minute"
    for unit, size in (("day", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            n = int(seconds // size)
            text = f"{n} {unit}{'s' if unit == 'day' and n != 1 else ''}"
            return f"in {text}" if future else f"{text} ago"
    raise AssertionError("unreachable")


def fmt_count(value: int | None) -> str:
    return NONE if value is None else f"{value:,}"


def fmt_limit(value: int | None) -> str:
    return "no limit" if value is None else f"{value:,}"


def fmt_bytes(value: int) -> str:
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def fmt_value(value: Any) -> str:
    """A JSON value of an audit snapshot, short and readable."""
    if value is None:
        return "not set"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, (list, tuple)):
        return ", ".join(fmt_value(v) for v in value) or "none"
    if isinstance(value, str):
        try:  # snapshots keep times as ISO strings
            parsed = dt.datetime.fromisoformat(value)
        except ValueError:
            return value
        if parsed.tzinfo is not None and "T" in value:
            return fmt_time(parsed)
        return value
    return str(value)


# ---- forms -----------------------------------------------------------------------------------


class FormErrors(dict[str, str]):
    """Field name → what is wrong with it; ``"_"`` holds a message for the whole form."""

    def add_api_error(self, error: APIError, default_field: str = "_") -> None:
        self[error.param if error.param else default_field] = error.message


def whole_number(text: str, max_digits: int = 13) -> int | None:
    """``text`` as a whole number when it is at most ``max_digits`` ASCII digits, else None.

    Not ``str.isdigit`` alone: it accepts '²' and other digits ``int`` refuses (a 500), and an
    unbounded length would build a huge int from a caller's text.
    """
    if text.isascii() and text.isdigit() and len(text) <= max_digits:
        return int(text)
    return None


def parse_limit(text: str, label: str) -> tuple[int | None, str | None]:
    """A quota from a form: blank → no limit; else a whole number from 1 to 10^12.
    Returns ``(value, error)``."""
    text = text.strip().replace(",", "").replace("_", "")
    if not text:
        return None, None
    value = whole_number(text)
    if value is None or not 1 <= value <= MAX_QUOTA:
        return None, (
            f"{label}: enter a whole number from 1 to 1,000,000,000,000, or leave it blank "
            "for no limit."
        )
    return value, None


def parse_quotas(fields: dict[str, str], errors: FormErrors) -> dict[str, int | None]:
    """The four quotas of a submitted form (``fields``: name → text); errors by field."""
    out: dict[str, int | None] = {}
    for name, label in QUOTA_LABELS.items():
        value, error = parse_limit(fields.get(name, ""), label)
        if error:
            errors[name] = error
        out[name] = value
    return out


SCHEDULING_LABELS: dict[str, str] = {"weight": "Weight", "max_priority": "Most urgent priority"}
MAX_NUMBER_TEXT = 20  # characters of a weight or a priority a form may hold


def parse_scheduling(fields: dict[str, str], errors: FormErrors) -> tuple[float | None, int | None]:
    """A form's weight and most urgent priority (None where left blank); errors by field."""
    weight: float | None = None
    priority: int | None = None
    text = fields.get("weight", "").strip()[: MAX_NUMBER_TEXT + 1]
    if text:
        try:
            weight = float(text) if len(text) <= MAX_NUMBER_TEXT and text.isascii() else -1.0
        except ValueError:
            weight = -1.0
        if not MIN_WEIGHT <= weight <= MAX_WEIGHT:  # also nan and inf
            weight = None
            errors["weight"] = (
                f"Weight: enter a number from {MIN_WEIGHT:g} to {MAX_WEIGHT:g} (1 is an equal "
                "share; 2 gets twice the share of a tenant of weight 1 when both wait)."
            )
    text = fields.get("max_priority", "").strip()
    if text:
        low, high = PRIORITY_RANGE
        sign, digits = (-1, text[1:]) if text.startswith("-") else (1, text)
        number = whole_number(digits, len(str(high)))
        if number is None or not low <= sign * number <= high:
            errors["max_priority"] = (
                f"Most urgent priority: enter a whole number from {low} to {high} (lower runs "
                "earlier; 0 lets the tenant send no priority ahead of the default)."
            )
        else:
            priority = sign * number
    return weight, priority


def page_number(text: str | None) -> int:
    """``?page=`` as a number from 1 to ``MAX_PAGE_NUMBER`` (absent or blank: 1; past the last
    page: the caller shows the last); anything else is a 400 page saying the range."""
    if not text:
        return 1
    number = whole_number(text, len(str(MAX_PAGE_NUMBER)))
    if number is None or not 1 <= number <= MAX_PAGE_NUMBER:
        raise Refused(
            400,
            "No such page",
            f"The page number must be a whole number from 1 to {MAX_PAGE_NUMBER:,}; the "
            f"address has page={text[:20]!r}. Open the list again from its first page.",
        )
    return number


# ---- pagination ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pager:
    """Offset pages of ``size`` rows over ``total`` rows; ``number`` counts from 1."""

    number: int
    size: int
    total: int

    @property
    def last(self) -> int:
        return max(1, -(-self.total // self.size))

    @property
    def offset(self) -> int:
        return (self.number - 1) * self.size

    @property
    def first_row(self) -> int:
        return self.offset + 1 if self.total else 0

    def last_row(self, shown: int) -> int:
        return self.offset + shown

    def clamped(self) -> Pager:
        return Pager(min(self.number, self.last), self.size, self.total)

    def link(self, path: str, number: int, params: Iterable[tuple[str, str]]) -> str:
        query = [(k, v) for k, v in params if v] + ([("page", str(number))] if number > 1 else [])
        return path + (f"?{urlencode(query)}" if query else "")


# ---- answers ---------------------------------------------------------------------------------


def not_found(what: str, back: tuple[str, str]) -> Refused:
    """The 404 page: ``what`` (e.g. "No tenant named 'x'.") and the way back (label, path)."""
    return Refused(404, "Not found", f"{what} It may have been deleted or renamed.", action=back)
