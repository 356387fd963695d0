"""Who may write events into the WAL (``source = "wal"``, issue 51).

A WAL event is a logical-decoding message under the configured prefix, written with
``pg_logical_emit_message``, which PostgreSQL lets PUBLIC execute: any role that can
connect could emit one, and the relay would publish it to the real topic under the
service's ``ce_source`` (a forged ``payment.refund.approved``, say), with no INSERT
privilege on any table. The remedy is a grant: revoke EXECUTE from PUBLIC, grant it to the
producers' roles (and the relay's: its heartbeat is an empty message). This module writes
that SQL; ``outbox wal setup --producer-role ROLE`` runs it (as a superuser: the function
belongs to the bootstrap superuser, and only its owner may grant it) or prints it
(``--print-sql``); ``doctor`` fails while PUBLIC may still execute it::

    from outbox.ops.wal_grants import restrict_sql
    print(restrict_sql(["billing_app"], job_roles=["outbox_producer", "outbox_relay"]))

Function privileges are per database: run it in the database the producers write to.

Why a grant and not a signature on each message (a key shared by producers and relays):
a role allowed to emit messages is, by PostgreSQL's own rules, a role allowed to write the
outbox; a signature would add a secret that every producer process holds, so that any code
that can read the producers' configuration can forge events again, and a key rotation
that must reach producers and relays at once. The grant puts the boundary where the
table source has it, in the database's privileges, checked by the server on every call.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.dialects import postgresql

_PREPARER = postgresql.dialect().identifier_preparer  # type: ignore[no-untyped-call]
_EACH_SIGNATURE = (
    "SELECT p.oid::regprocedure FROM pg_proc p WHERE p.proname = 'pg_logical_emit_message'"
    " AND p.pronamespace = 'pg_catalog'::regnamespace"
)


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def restrict_sql(roles: Sequence[str], job_roles: Sequence[str] = ()) -> str:
    """One ``DO`` block, idempotent: for each signature of ``pg_logical_emit_message`` (they
    differ between PostgreSQL versions), EXECUTE granted to ``roles`` (each must exist: a
    misspelt producer role fails the block before anything is revoked), to those of
    ``job_roles`` that exist (``outbox db sql --roles``) and to the role running it, then
    revoked from PUBLIC. One transaction: all of it or nothing."""
    # Concatenation, not format('%s %I'): no percent sign, which drivers that take
    # pyformat parameters (psycopg through SQLAlchemy) would read as a placeholder.
    grant = "EXECUTE 'GRANT EXECUTE ON FUNCTION ' || f::text || ' TO ' || quote_ident({});"
    steps = [grant.format(_literal(r)) for r in roles]
    steps += [
        f"IF EXISTS (SELECT FROM pg_roles WHERE rolname = {_literal(r)}) THEN "
        + grant.format(_literal(r))
        + " END IF;"
        for r in job_roles
    ]
    steps.append(grant.format("current_user"))
    steps.append("EXECUTE 'REVOKE EXECUTE ON FUNCTION ' || f::text || ' FROM PUBLIC';")
    return (
        f"DO $$ DECLARE f regprocedure; BEGIN FOR f IN {_EACH_SIGNATURE} LOOP "
        + " ".join(steps)
        + " END LOOP; END $$;"
    )


def restrict_comment(roles: Sequence[str]) -> str:
    """The lines ``outbox wal setup --print-sql`` puts before :func:`restrict_sql`."""
    who = ", ".join(_PREPARER.quote_identifier(r) for r in roles)
    return (
        "-- Only the producers and the relay may write WAL events: EXECUTE on\n"
        f"-- pg_logical_emit_message for {who}, the job roles and the role running this;\n"
        "-- revoked from PUBLIC (which PostgreSQL grants it to). Needs a superuser."
    )
