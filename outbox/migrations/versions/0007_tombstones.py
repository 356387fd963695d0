"""Tombstones: an outbox row (and a failed row) may carry no payload and no content type.

Revision ID: 0007
Revises: 0006
"""

from alembic import op

from outbox.migrations.naming import current

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

_TABLES = ("events", "failed")
_COLUMNS = ("payload", "content_type")


def upgrade() -> None:
    # DROP NOT NULL only changes the catalog: no table rewrite, no scan.
    schema, prefix = current(op)
    for table in _TABLES:
        for column in _COLUMNS:
            op.alter_column(f"{prefix}{table}", column, nullable=True, schema=schema)


def downgrade() -> None:
    # Fails (NotNullViolation) while a tombstone is still waiting in either table: relay or
    # purge it first. Deleting it here would drop an event.
    schema, prefix = current(op)
    for table in _TABLES:
        for column in _COLUMNS:
            op.alter_column(f"{prefix}{table}", column, nullable=False, schema=schema)
