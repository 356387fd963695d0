"""Idempotency keys table (idempotent requests, the Stripe pattern).

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from outbox.migrations.naming import current

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema, prefix = current(op)
    name = f"{prefix}idempotency_keys"
    op.create_table(
        name,
        sa.Column("scope", sa.Text, nullable=False),
        sa.Column("key", sa.Text, nullable=False),
        sa.Column("payload_hash", sa.Text, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("response_status", sa.Integer, nullable=True),
        sa.Column("response_headers", postgresql.JSONB, nullable=True),
        sa.Column("response_body", sa.LargeBinary, nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.text("now()"),
        ),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("locked_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("lock_token", postgresql.UUID(as_uuid=True), nullable=True),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("scope", "key", name=f"{name}_pkey"),
        sa.CheckConstraint(
            "status IN ('pending', 'complete', 'failed')", name=f"{name}_status_check"
        ),
        sa.CheckConstraint("char_length(key) BETWEEN 1 AND 255", name=f"{name}_key_length_check"),
        schema=schema,
    )
    op.create_index(f"{name}_expires_at_idx", name, ["expires_at"], schema=schema)


def downgrade() -> None:
    schema, prefix = current(op)
    op.drop_table(f"{prefix}idempotency_keys", schema=schema)
