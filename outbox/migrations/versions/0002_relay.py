"""Relay tables: failed rows and the relay registry.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from outbox.migrations.naming import current

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema, prefix = current(op)
    failed = f"{prefix}failed"
    op.create_table(
        failed,
        sa.Column("id", sa.BigInteger, nullable=False),
        sa.Column("event_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("key", sa.LargeBinary, nullable=True),
        sa.Column("lane", sa.SmallInteger, nullable=False),
        sa.Column("event_type", sa.Text, nullable=False),
        sa.Column("source", sa.Text, nullable=False),
        sa.Column("content_type", sa.Text, nullable=False),
        sa.Column("payload", sa.LargeBinary, nullable=False),
        sa.Column("headers", postgresql.JSONB, nullable=False),
        sa.Column("fingerprint", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column(
            "failed_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")
        ),
        sa.PrimaryKeyConstraint("id", name=f"{failed}_pkey"),
        sa.UniqueConstraint("event_id", name=f"{failed}_event_id_key"),
        schema=schema,
    )
    relays = f"{prefix}relays"
    op.create_table(
        relays,
        sa.Column("relay_id", sa.Text, nullable=False),
        sa.Column("hostname", sa.Text, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column(
            "started_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.text("now()"),
        ),
        sa.Column(
            "heartbeat_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.text("now()"),
        ),
        sa.Column(
            "lanes",
            postgresql.ARRAY(sa.SmallInteger),
            nullable=False,
            server_default=sa.text("'{}'"),
        ),
        sa.PrimaryKeyConstraint("relay_id", name=f"{relays}_pkey"),
        schema=schema,
    )


def downgrade() -> None:
    schema, prefix = current(op)
    op.drop_table(f"{prefix}relays", schema=schema)
    op.drop_table(f"{prefix}failed", schema=schema)
