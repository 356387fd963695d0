"""Inbox table: one row per (consumer, event_id) handled.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

from outbox.migrations.naming import current

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema, prefix = current(op)
    name = f"{prefix}inbox"
    op.create_table(
        name,
        sa.Column("consumer", sa.Text, nullable=False),
        sa.Column("event_id", sa.Text, nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("partition", sa.Integer, nullable=False),
        sa.Column("offset", sa.BigInteger, nullable=False),
        sa.Column("event_type", sa.Text, nullable=True),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")),
        sa.Column("processed_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("consumer", "event_id", name=f"{name}_pkey"),
        schema=schema,
    )
    op.create_index(f"{name}_processed_at_idx", name, ["processed_at"], schema=schema)


def downgrade() -> None:
    schema, prefix = current(op)
    op.drop_table(f"{prefix}inbox", schema=schema)
