"""Dead letters: which refusal kept a record from its dead-letter topic (issue 28).

A dead letter the dead-letter topic refuses as too large is kept in the table only (a
marker goes to the topic); ``dlq_refused`` names Kafka's error then, NULL otherwise.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

from outbox.migrations.naming import current

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema, prefix = current(op)
    # Nullable, no default: a catalog-only change, no table rewrite.
    op.add_column(
        f"{prefix}dead_letters", sa.Column("dlq_refused", sa.Text, nullable=True), schema=schema
    )


def downgrade() -> None:
    schema, prefix = current(op)
    op.drop_column(f"{prefix}dead_letters", "dlq_refused", schema=schema)
