"""Consumer figures per minute, for the console's throughput and processing-time charts.

Each consumer process adds what it counted (events processed, handler seconds, dead
letters, retries, duplicates) to its group's row of the current minute every few seconds
(``consumer.stats_seconds``), off the hot path; rows older than a day are deleted by the
members as they write.

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

from outbox.migrations.naming import current

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema, prefix = current(op)
    zero = sa.text("0")
    op.create_table(
        f"{prefix}consumer_stats",
        sa.Column("consumer", sa.Text, nullable=False),
        sa.Column("minute", sa.DateTime(timezone=True), nullable=False),
        sa.Column("processed", sa.BigInteger, nullable=False, server_default=zero),
        sa.Column("handler_seconds", sa.Double, nullable=False, server_default=zero),
        sa.Column("dead_lettered", sa.BigInteger, nullable=False, server_default=zero),
        sa.Column("retries", sa.BigInteger, nullable=False, server_default=zero),
        sa.Column("duplicates", sa.BigInteger, nullable=False, server_default=zero),
        sa.PrimaryKeyConstraint("consumer", "minute", name=f"{prefix}consumer_stats_pkey"),
        schema=schema,
    )


def downgrade() -> None:
    schema, prefix = current(op)
    op.drop_table(f"{prefix}consumer_stats", schema=schema)
