"""Relays: every relay registers, whatever its source; one of them runs maintenance (issue 46).

``source`` says where a relay reads events (``table`` or ``wal``: a WAL relay owns no lanes),
``maintenance`` whether it is the one relay running the maintenance services (retention,
the dead-tuple and snapshot watches) — the holder of the maintenance leader's lock.

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

from outbox.migrations.naming import current

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema, prefix = current(op)
    # Constant defaults: catalog-only changes, no table rewrite (PostgreSQL 11+).
    op.add_column(
        f"{prefix}relays",
        sa.Column("source", sa.Text, nullable=False, server_default=sa.text("'table'")),
        schema=schema,
    )
    op.add_column(
        f"{prefix}relays",
        sa.Column("maintenance", sa.Boolean, nullable=False, server_default=sa.text("false")),
        schema=schema,
    )


def downgrade() -> None:
    schema, prefix = current(op)
    op.drop_column(f"{prefix}relays", "maintenance", schema=schema)
    op.drop_column(f"{prefix}relays", "source", schema=schema)
