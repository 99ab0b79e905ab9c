"""What platform replicas on one database share: quota leases, admin UI sessions, a change feed
(released adapter content), and the stored adapters' files in chunks.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-08
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | tuple[str, ...] | None = None
depends_on: str | tuple[str, ...] | None = None


def _key() -> sa.types.TypeEngine[int]:
    # 64-bit on PostgreSQL; on SQLite only INTEGER aliases the (64-bit) rowid.
    return sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "quota_leases",
        sa.Column("id", _key(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("replica_id", sa.String(length=64), nullable=False),
        sa.Column("admitted_at", sa.Float(), nullable=False),
        sa.Column("estimated_tokens", sa.BigInteger(), nullable=False),
        sa.Column("actual_tokens", sa.BigInteger(), nullable=True),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name="fk_quota_leases_tenant_id_tenants",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_quota_leases"),
    )
    op.create_index(
        "ix_quota_leases_tenant_id_admitted_at", "quota_leases", ["tenant_id", "admitted_at"]
    )
    op.create_index(
        "ix_quota_leases_replica_id_finished_at", "quota_leases", ["replica_id", "finished_at"]
    )
    op.create_table(
        "admin_sessions",
        sa.Column("id_sha256", sa.String(length=64), nullable=False),
        sa.Column("csrf_token", sa.String(length=64), nullable=False),
        sa.Column("credential_version", sa.String(length=64), nullable=False),
        sa.Column("created", sa.Float(), nullable=False),
        sa.Column("last_seen", sa.Float(), nullable=False),
        sa.Column("flashes", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id_sha256", name="pk_admin_sessions"),
    )
    op.create_index("ix_admin_sessions_last_seen", "admin_sessions", ["last_seen"])
    op.create_table(
        "platform_events",
        sa.Column("id", _key(), autoincrement=True, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("content_sha256", sa.String(length=64), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_platform_events"),
    )
    op.create_index("ix_platform_events_created_at", "platform_events", ["created_at"])
    op.create_table(
        "adapter_blobs",
        sa.Column("content_sha256", sa.String(length=64), nullable=False),
        sa.Column("file_name", sa.String(length=64), nullable=False),
        sa.Column("chunk", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("content_sha256", "file_name", "chunk", name="pk_adapter_blobs"),
    )


def downgrade() -> None:
    op.drop_table("adapter_blobs")
    op.drop_index("ix_platform_events_created_at", table_name="platform_events")
    op.drop_table("platform_events")
    op.drop_index("ix_admin_sessions_last_seen", table_name="admin_sessions")
    op.drop_table("admin_sessions")
    op.drop_index("ix_quota_leases_replica_id_finished_at", table_name="quota_leases")
    op.drop_index("ix_quota_leases_tenant_id_admitted_at", table_name="quota_leases")
    op.drop_table("quota_leases")
