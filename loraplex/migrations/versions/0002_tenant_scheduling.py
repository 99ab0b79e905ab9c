"""Tenants' scheduling settings: ``weight`` (their share of the engine when backlogged, under
the fair policy) and ``max_priority`` (the most urgent request priority they may ask for; lower
runs earlier).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | tuple[str, ...] | None = None
depends_on: str | tuple[str, ...] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(
            sa.Column("weight", sa.Float(), nullable=False, server_default=sa.text("1.0"))
        )
        batch.add_column(
            sa.Column("max_priority", sa.Integer(), nullable=False, server_default=sa.text("0"))
        )


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("max_priority")
        batch.drop_column("weight")
