"""The request log (``request_logs``: one row per API request, refused ones too) and the
tenants' opt-in to bodies in it (``request_log_settings``).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | tuple[str, ...] | None = None
depends_on: str | tuple[str, ...] | None = None


def _key() -> sa.types.TypeEngine[int]:
    # 64-bit on PostgreSQL; on SQLite only INTEGER aliases the (64-bit) rowid.
    return sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "request_logs",
        sa.Column("id", _key(), autoincrement=True, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=True),
        sa.Column("key_id", sa.String(length=32), nullable=True),
        sa.Column("method", sa.String(length=8), nullable=False),
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=140), nullable=True),
        sa.Column("served_model", sa.String(length=140), nullable=True),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("error_code", sa.String(length=64), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("duration_ms", sa.Float(), nullable=False),
        sa.Column("finish_reason", sa.String(length=64), nullable=True),
        sa.Column("request_id", sa.String(length=64), nullable=False),
        sa.Column("stream", sa.Boolean(), nullable=False),
        sa.Column("request_body", sa.Text(), nullable=True),
        sa.Column("response_body", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name="fk_request_logs_tenant_id_tenants",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_request_logs"),
    )
    op.create_index("ix_request_logs_created_at", "request_logs", ["created_at"])
    op.create_index("ix_request_logs_request_id_id", "request_logs", ["request_id", "id"])
    op.create_index("ix_request_logs_tenant_id_id", "request_logs", ["tenant_id", "id"])
    op.create_index("ix_request_logs_key_id_id", "request_logs", ["key_id", "id"])
    op.create_index("ix_request_logs_served_model_id", "request_logs", ["served_model", "id"])
    op.create_table(
        "request_log_settings",
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("body_max_bytes", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name="fk_request_log_settings_tenant_id_tenants",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("tenant_id", name="pk_request_log_settings"),
    )


def downgrade() -> None:
    op.drop_table("request_log_settings")
    for name in ("served_model_id", "key_id_id", "tenant_id_id", "request_id_id", "created_at"):
        op.drop_index(f"ix_request_logs_{name}", table_name="request_logs")
    op.drop_table("request_logs")
