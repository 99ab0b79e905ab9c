"""What a viewer (the admin UI's read-only role) sees of a webhook: a receiver's URL often
carries a credential in its path or query (Slack's and Teams' incoming webhooks do), so a viewer
gets the scheme and host only, and a delivery's error without the redirect target it names."""

from __future__ import annotations

from urllib.parse import urlsplit

HIDDEN = "…"


def viewer_url(url: str) -> str:
    """``https://hooks.example.com/…``: the origin, the rest hidden (nothing hidden when the URL
    has no path, query or fragment beyond ``/``)."""
    parts = urlsplit(url)
    rest = (parts.path not in ("", "/")) or bool(parts.query) or bool(parts.fragment)
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port is not None else ""
    return f"{parts.scheme}://{host}{port}/" + (HIDDEN if rest else "")


def viewer_error(error: str | None) -> str | None:
    """A delivery's last error with a redirect's ``Location`` reduced like a URL."""
    if error is None or "(Location: " not in error:
        return error
    head, _, _ = error.partition("(Location: ")
    return f"{head}(Location: {HIDDEN})"
