"""The outbox events table.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from outbox.migrations.naming import current, qualified
from outbox.tables import HOT_TABLE_STORAGE

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema, prefix = current(op)
    name = f"{prefix}events"
    op.create_table(
        name,
        sa.Column("id", sa.BigInteger, sa.Identity(always=False), primary_key=True),
        sa.Column("event_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("key", sa.LargeBinary, nullable=True),
        sa.Column("lane", sa.SmallInteger, nullable=False),
        sa.Column("event_type", sa.Text, nullable=False),
        sa.Column("source", sa.Text, nullable=False),
        sa.Column("content_type", sa.Text, nullable=False),
        sa.Column("payload", sa.LargeBinary, nullable=False),
        sa.Column(
            "headers", postgresql.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")
        ),
        sa.Column("fingerprint", sa.LargeBinary, nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.text("now()"),
        ),
        sa.Column(
            "available_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.text("now()"),
        ),
        sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("published_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=f"{name}_pkey"),
        sa.UniqueConstraint("event_id", name=f"{name}_event_id_key"),
        schema=schema,
    )
    op.create_index(
        f"{name}_claim_idx",
        name,
        ["lane", "id"],
        schema=schema,
        postgresql_where=sa.text("published_at IS NULL"),
    )
    storage = ", ".join(f"{k} = {v}" for k, v in HOT_TABLE_STORAGE.items())
    op.execute(f"ALTER TABLE {qualified(op, schema, name)} SET ({storage})")


def downgrade() -> None:
    schema, prefix = current(op)
    op.drop_table(f"{prefix}events", schema=schema)
