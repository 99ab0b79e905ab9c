"""Alert webhooks (issue 34.2): operator-managed subscriptions (URL, events, secret) to the
platform's alerts, delivered as signed JSON POSTs by a background worker.

    settings.py   LORAPLEX_WEBHOOK_* (attempt timeout, attempts, backoff, thresholds)
    signing.py    X-Loraplex-Signature: t=<unix>,v1=HMAC-SHA256(secret, "<t>.<body>")
    sender.py     one POST with one deadline, no redirects, http(s) only
    store.py      subscriptions, events (once per event id), deliveries (claimed in the database)
    service.py    WebhookService: the sources, the checks and the worker
    cli.py        ``loraplex admin webhook ...``

The delivered body::

    {"id": "evt_<32 hex>", "type": "budget.soft_limit_crossed",
     "created_at": "2026-12-05T10:00:00+00:00", "data": {...}}

with headers ``X-Loraplex-Event-Id``, ``X-Loraplex-Event-Type``,
``X-Loraplex-Delivery-Attempt`` and ``X-Loraplex-Signature``. A delivery is retried (with the
same body and event id) until a 2xx, at most ``max_attempts`` times.
"""
