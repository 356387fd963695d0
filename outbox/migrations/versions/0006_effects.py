"""The side-effect ledger: one row per intended external effect (issue 15).

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from outbox.migrations.naming import current

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema, prefix = current(op)
    name = f"{prefix}effects"
    now = sa.text("now()")
    op.create_table(
        name,
        sa.Column("key", sa.Text, nullable=False),
        sa.Column("payload_hash", sa.Text, nullable=False),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("dependency", sa.Text, nullable=False),
        sa.Column("result", postgresql.JSONB, nullable=True),
        sa.Column("error", postgresql.JSONB, nullable=True),
        sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("dedupe_window", sa.Interval, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=now),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=now),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("lock_token", postgresql.UUID(as_uuid=True), nullable=True),
        sa.PrimaryKeyConstraint("key", name=f"{name}_pkey"),
        sa.CheckConstraint(
            "state IN ('pending', 'done', 'failed', 'unknown')", name=f"{name}_state_check"
        ),
        sa.CheckConstraint("char_length(key) BETWEEN 1 AND 255", name=f"{name}_key_length_check"),
        schema=schema,
    )
    op.create_index(
        f"{name}_expires_at_idx",
        name,
        ["expires_at"],
        schema=schema,
        postgresql_where=sa.text("expires_at IS NOT NULL"),
    )
    op.create_index(f"{name}_state_idx", name, ["state", "updated_at"], schema=schema)


def downgrade() -> None:
    schema, prefix = current(op)
    op.drop_table(f"{prefix}effects", schema=schema)
