"""Webhook settings: ``LORAPLEX_WEBHOOK_<NAME>`` environment variables override them."""

from __future__ import annotations

from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class WebhookSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LORAPLEX_WEBHOOK_", extra="ignore", frozen=True)

    timeout_s: float = Field(
        5.0, gt=0, le=60, description="one delivery attempt, connect to status line"
    )
    max_attempts: int = Field(6, ge=1, le=20, description="attempts per delivery, the first too")
    retry_base_s: float = Field(
        10.0, gt=0, le=3600, description="the wait after the first failure; doubled each time"
    )
    poll_s: float = Field(
        2.0, gt=0, le=60, description="how often a replica looks for deliveries due"
    )
    max_in_flight: int = Field(8, ge=1, le=256, description="deliveries sent at once")
    quota_refusals: int = Field(
        10, ge=1, description="per-minute quota refusals of a tenant, in one window, that alert"
    )
    quota_window_s: float = Field(
        300.0, ge=1, description="the window (fixed, aligned to the epoch) they are counted in"
    )
    key_expiry_hours: float = Field(
        72.0, gt=0, description="keys expiring within this many hours alert once"
    )
    retention_days: float = Field(
        30.0, gt=0, description="events (with their deliveries) older than this are deleted"
    )
    check_interval_s: float = Field(
        300.0, gt=0, description="how often expiring keys and engine restarts are looked for"
    )


def load_webhook_settings(**overrides: Any) -> WebhookSettings:
    return WebhookSettings(**{k: v for k, v in overrides.items() if v is not None})
