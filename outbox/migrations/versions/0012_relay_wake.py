"""The relay's wake-up: a statement trigger on the outbox table that notifies while a relay
sleeps (outbox/wake.py says why only then, and why no wake-up is ever lost).

Revision ID: 0012
Revises: 0011
"""

from alembic import op

from outbox.migrations.naming import current, qualified
from outbox.wake import trigger_function_sql, trigger_name

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def _names() -> tuple[str, str, str, str, str]:
    schema, prefix = current(op)
    prep = op.get_context().dialect.identifier_preparer
    function = qualified(op, schema, trigger_name(prefix))
    return (
        schema,
        prefix,
        function,
        prep.quote(trigger_name(prefix)),
        qualified(op, schema, f"{prefix}events"),
    )


def upgrade() -> None:
    schema, prefix, function, trigger, events = _names()
    op.execute(trigger_function_sql(function, schema, prefix))
    op.execute(
        f"CREATE TRIGGER {trigger} AFTER INSERT ON {events}"
        f" FOR EACH STATEMENT EXECUTE FUNCTION {function}()"
    )


def downgrade() -> None:
    _, _, function, trigger, events = _names()
    op.execute(f"DROP TRIGGER IF EXISTS {trigger} ON {events}")
    op.execute(f"DROP FUNCTION IF EXISTS {function}()")
