"""Stale-event guard: the highest applied sequence per (consumer, key).

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

from outbox.migrations.naming import current

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema, prefix = current(op)
    name = f"{prefix}inbox_sequences"
    op.create_table(
        name,
        sa.Column("consumer", sa.Text, nullable=False),
        sa.Column("key", sa.LargeBinary, nullable=False),
        sa.Column("sequence", sa.BigInteger, nullable=False),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.text("now()"),
        ),
        sa.PrimaryKeyConstraint("consumer", "key", name=f"{name}_pkey"),
        schema=schema,
    )


def downgrade() -> None:
    schema, prefix = current(op)
    op.drop_table(f"{prefix}inbox_sequences", schema=schema)
