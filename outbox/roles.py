"""Least-privilege PostgreSQL roles, one per job (``outbox db sql --roles``).

The script creates five NOLOGIN group roles and grants each what its job needs on the
framework's tables of the configured schema and prefix; login users are then made members
(``CREATE ROLE billing_relay LOGIN PASSWORD ... IN ROLE outbox_relay``). Migrations keep
running as the tables' owner. Advisory locks (the relay's lanes) need no grant.

* producer — the application: INSERT into the outbox, and SELECT of the columns
  ``publish()`` reads to detect a reused ``event_id``; no UPDATE, no DELETE, no other rows'
  state. Also the application-side tables: idempotent requests and the effects ledger.
* relay — claims (``FOR UPDATE SKIP LOCKED`` needs UPDATE), deletes or marks published rows,
  puts back unacknowledged ones (INSERT), moves rejected ones to ``failed``, its heartbeat
  table ``relays``; reads the outbox id sequence's last value (the claim horizon,
  relay/sources/table/cursor.py; ``pg_locks`` needs no grant).
* consumer — the inbox, attempt markers, dead letters, sequence guard, and the effects
  ledger; never the outbox (a handler that publishes gets the producer role too). The
  user's own tables are the user's to grant.
* operator — reads everything (``lag``, ``doctor``, listings); deletes for ``cleanup`` and
  ``purge`` (its batches lock with ``FOR UPDATE SKIP LOCKED``, so UPDATE too); INSERT into
  the outbox for ``failed retry``; membership in ``pg_read_all_stats`` where the script's
  runner may grant it, so that ``doctor`` can show the state and query of a session that
  holds back VACUUM (without it PostgreSQL shows only its pid and application name).
* viewer — reads everything and changes nothing: the read-only console (``outbox console``
  without ``--allow-actions``), ``lag``, ``doctor``, the listings; ``pg_read_all_stats``
  like the operator.
"""

from __future__ import annotations

from sqlalchemy.dialects import postgresql

from outbox import identifiers
from outbox.migrations.naming import version_table
from outbox.settings import OutboxSettings
from outbox.tables import build_tables

JOBS = ("producer", "relay", "consumer", "operator", "viewer")
_PREPARER = postgresql.dialect().identifier_preparer  # type: ignore[no-untyped-call]
# Columns publish() reads back (fingerprint check and the mismatch report).
_PRODUCER_READS = (
    "event_id",
    "fingerprint",
    "topic",
    "key",
    "event_type",
    "content_type",
    "payload",
)
_ALL = "SELECT, INSERT, UPDATE, DELETE"


def role_names(role_prefix: str) -> dict[str, str]:
    """Job -> role name (``outbox_`` + job by default)."""
    prefix = identifiers.table_prefix(role_prefix)
    return {job: f"{prefix}{job}" for job in JOBS}


def roles_sql(settings: OutboxSettings, role_prefix: str | None = None) -> str:
    """The SQL script creating the job roles (idempotent: existing roles are kept, grants
    are re-applied) for ``settings``' schema and table prefix."""
    q = _PREPARER.quote_identifier
    t = build_tables(settings)
    schema = q(settings.db_schema)

    def table(name: str) -> str:
        return f"{schema}.{q(name)}"

    def tables(*names: str) -> str:
        return ", ".join(table(getattr(t, n).name) for n in names)

    roles = role_names(settings.table_prefix if role_prefix is None else role_prefix)
    r = {job: q(name) for job, name in roles.items()}
    everyone = ", ".join(r.values())
    every_table = [f.name for f in t.metadata.sorted_tables]
    lines = [
        f"-- outbox-inbox job roles for schema {settings.db_schema}, table prefix "
        f"{settings.table_prefix}.",
        "-- Run as the tables' owner after `outbox db upgrade`; then, per process:",
        f"--   CREATE ROLE app_relay LOGIN PASSWORD '...' IN ROLE {roles['relay']};",
        "BEGIN;",
    ]
    lines += [_create_role(name) for name in roles.values()]
    lines += [
        f"GRANT USAGE ON SCHEMA {schema} TO {everyone};",
        f"GRANT SELECT ON {table(version_table(settings))} TO {everyone};",
        "-- producer",
        f"GRANT INSERT ON {tables('events')} TO {r['producer']};",
        f"GRANT SELECT ({', '.join(q(c) for c in _PRODUCER_READS)}) ON {tables('events')} "
        f"TO {r['producer']};",
        f"GRANT {_ALL} ON {tables('idempotency', 'effects')} TO {r['producer']};",
        "-- relay",
        f"GRANT {_ALL} ON {tables('events', 'relays')} TO {r['relay']};",
        f"GRANT SELECT, INSERT, UPDATE ON {tables('failed')} TO {r['relay']};",
        _grant_id_sequence(table(t.events.name), roles["relay"]),
        "-- consumer",
        f"GRANT {_ALL} ON "
        f"{tables('inbox', 'inbox_attempts', 'dead_letters', 'inbox_sequences', 'effects')}, "
        f"{tables('consumer_stats')} TO {r['consumer']};",
        "-- operator",
        f"GRANT SELECT, UPDATE, DELETE ON {', '.join(table(n) for n in every_table)} "
        f"TO {r['operator']};",
        f"GRANT INSERT ON {tables('events')} TO {r['operator']};",
        _grant_membership("pg_read_all_stats", roles["operator"]),
        "-- viewer",
        f"GRANT SELECT ON {', '.join(table(n) for n in every_table)} TO {r['viewer']};",
        _grant_membership("pg_read_all_stats", roles["viewer"]),
        "COMMIT;",
    ]
    return "\n".join(lines) + "\n"


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _grant_id_sequence(table: str, role: str) -> str:
    # The identity sequence's name is PostgreSQL's to choose: look it up where it runs.
    return (
        "DO $$ BEGIN EXECUTE format('GRANT SELECT ON SEQUENCE %s TO %I', "
        f"pg_get_serial_sequence({_literal(table)}, 'id'), {_literal(role)}); END $$;"
    )


def _grant_membership(group: str, role: str) -> str:
    # Granting a predefined role needs CREATEROLE (PostgreSQL 15) or its ADMIN OPTION: not
    # every owner has either, and the rest of the script does not depend on it.
    return (
        f"DO $$ BEGIN EXECUTE format('GRANT %I TO %I', {_literal(group)}, {_literal(role)}); "
        "EXCEPTION WHEN insufficient_privilege THEN RAISE NOTICE "
        f"'could not grant % to % (ask a superuser to)', {_literal(group)}, {_literal(role)}; "
        "END $$;"
    )


def _create_role(name: str) -> str:
    # CREATE ROLE has no IF NOT EXISTS; a role made meanwhile by a concurrent run is fine.
    literal = name.replace("'", "''")
    return (
        f"DO $$ BEGIN CREATE ROLE {_PREPARER.quote_identifier(name)} NOLOGIN; "
        f"EXCEPTION WHEN duplicate_object THEN RAISE NOTICE 'role % exists', '{literal}'; "
        "END $$;"
    )
