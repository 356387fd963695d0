"""Inbox tables: handled events, durable attempt markers, dead letters.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from outbox.migrations.naming import current

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def _now() -> sa.TextClause:
    return sa.text("now()")


def upgrade() -> None:
    schema, prefix = current(op)
    inbox = f"{prefix}inbox"
    op.create_table(
        inbox,
        sa.Column("consumer", sa.Text, nullable=False),
        sa.Column("event_id", sa.Text, nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("partition", sa.Integer, nullable=False),
        sa.Column("offset", sa.BigInteger, nullable=False),
        sa.Column("event_type", sa.Text, nullable=True),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False, server_default=_now()),
        sa.Column("processed_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("consumer", "event_id", name=f"{inbox}_pkey"),
        schema=schema,
    )
    op.create_index(f"{inbox}_processed_at_idx", inbox, ["processed_at"], schema=schema)

    attempts = f"{prefix}inbox_attempts"
    op.create_table(
        attempts,
        sa.Column("consumer", sa.Text, nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("partition", sa.Integer, nullable=False),
        sa.Column("start_offset", sa.BigInteger, nullable=False),
        sa.Column("end_offset", sa.BigInteger, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=_now()),
        sa.PrimaryKeyConstraint("consumer", "topic", "partition", name=f"{attempts}_pkey"),
        schema=schema,
    )

    dead = f"{prefix}dead_letters"
    op.create_table(
        dead,
        sa.Column("consumer", sa.Text, nullable=False),
        sa.Column("event_id", sa.Text, nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("partition", sa.Integer, nullable=False),
        sa.Column("offset", sa.BigInteger, nullable=False),
        sa.Column("event_type", sa.Text, nullable=True),
        sa.Column("key", sa.LargeBinary, nullable=True),
        sa.Column("value", sa.LargeBinary, nullable=True),
        sa.Column("header_names", postgresql.ARRAY(sa.Text), nullable=False),
        sa.Column("header_values", postgresql.ARRAY(sa.LargeBinary), nullable=False),
        sa.Column("error_class", sa.Text, nullable=False),
        sa.Column("error_message", sa.Text, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("dlq_topic", sa.Text, nullable=False),
        sa.Column("dlq_partition", sa.Integer, nullable=True),
        sa.Column("dlq_offset", sa.BigInteger, nullable=True),
        sa.Column(
            "dead_lettered_at", sa.DateTime(timezone=True), nullable=False, server_default=_now()
        ),
        sa.Column("replays", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("replayed_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("consumer", "event_id", name=f"{dead}_pkey"),
        schema=schema,
    )
    op.create_index(f"{dead}_dead_lettered_at_idx", dead, ["dead_lettered_at"], schema=schema)


def downgrade() -> None:
    schema, prefix = current(op)
    op.drop_table(f"{prefix}dead_letters", schema=schema)
    op.drop_table(f"{prefix}inbox_attempts", schema=schema)
    op.drop_table(f"{prefix}inbox", schema=schema)
