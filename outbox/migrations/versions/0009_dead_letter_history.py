"""Dead letters keep why they failed: each attempt's time, error, stack trace and member.

``history`` is a JSON array of the attempts that led to the dead letter, one object per
failed attempt (time, attempt number, replay number, error class and message, the first
application frame, the formatted stack trace, host, pid, instance id, seconds it ran); a
replay that fails again appends its attempts. Rows dead-lettered before this revision
keep an empty history (their error columns still say what failed last).

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

from outbox.migrations.naming import current

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema, prefix = current(op)
    # A constant default is kept in the catalog (PostgreSQL 11+): no table rewrite.
    op.add_column(
        f"{prefix}dead_letters",
        sa.Column("history", JSONB, nullable=False, server_default=sa.text("'[]'::jsonb")),
        schema=schema,
    )


def downgrade() -> None:
    schema, prefix = current(op)
    op.drop_column(f"{prefix}dead_letters", "history", schema=schema)
