"""Budgets per tenant and per key (``budgets``), the operator's price table (``model_prices``)
and the record of budgets' soft / hard limit crossings (``budget_alerts``).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | tuple[str, ...] | None = None
depends_on: str | tuple[str, ...] | None = None


def _key() -> sa.types.TypeEngine[int]:
    # 64-bit on PostgreSQL; on SQLite only INTEGER aliases the (64-bit) rowid.
    return sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "budgets",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("api_key_id", sa.Integer(), nullable=True),
        sa.Column("metric", sa.String(length=8), nullable=False),
        sa.Column("period", sa.String(length=8), nullable=False),
        sa.Column("anchor", sa.String(length=8), nullable=False),
        sa.Column("limit_amount", sa.Float(), nullable=False),
        sa.Column("soft_percent", sa.Float(), nullable=True),
        sa.Column("prompt_weight", sa.Float(), nullable=False),
        sa.Column("completion_weight", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_budgets_tenant_id_tenants", ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["api_key_id"],
            ["api_keys.id"],
            name="fk_budgets_api_key_id_api_keys",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_budgets"),
    )
    op.create_index("ix_budgets_tenant_id", "budgets", ["tenant_id"])
    op.create_index("ix_budgets_api_key_id", "budgets", ["api_key_id"])
    op.create_table(
        "model_prices",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("base_model", sa.String(length=140), nullable=True),
        sa.Column("adapter_id", sa.Integer(), nullable=True),
        sa.Column("prompt_per_million", sa.Float(), nullable=False),
        sa.Column("completion_per_million", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["adapter_id"],
            ["adapters.id"],
            name="fk_model_prices_adapter_id_adapters",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_model_prices"),
        sa.UniqueConstraint("adapter_id", name="uq_model_prices_adapter_id"),
        sa.UniqueConstraint("base_model", name="uq_model_prices_base_model"),
    )
    op.create_table(
        "budget_alerts",
        sa.Column("id", _key(), autoincrement=True, nullable=False),
        sa.Column("budget_id", sa.Integer(), nullable=False),
        sa.Column("period_start", sa.Float(), nullable=False),
        sa.Column("level", sa.String(length=8), nullable=False),
        sa.Column("used", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["budget_id"],
            ["budgets.id"],
            name="fk_budget_alerts_budget_id_budgets",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_budget_alerts"),
        sa.UniqueConstraint(
            "budget_id", "period_start", "level", name="uq_budget_alerts_budget_id"
        ),
    )


def downgrade() -> None:
    op.drop_table("budget_alerts")
    op.drop_table("model_prices")
    op.drop_index("ix_budgets_api_key_id", table_name="budgets")
    op.drop_index("ix_budgets_tenant_id", table_name="budgets")
    op.drop_table("budgets")
