"""SQLAlchemy Core table definitions, built for a configured schema and table prefix.

``build_tables(settings)`` returns a :class:`Tables` holding one ``MetaData``; users who
keep their own Alembic history add ``tables.metadata`` to their ``target_metadata`` (and
:func:`outbox.ops.alembic_env.storage_directives` to their ``env.py`` for the storage
parameters, which SQLAlchemy's table DDL cannot carry).
The shipped migrations (``outbox/migrations``) create exactly these tables; a schema-drift
test compares the two.

Sections of this file belong to the package that uses the table: the outbox events table
is core; the inbox, idempotency and relay tables are declared next to it so that one
MetaData describes the whole database footprint.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Double,
    Identity,
    Index,
    Integer,
    Interval,
    LargeBinary,
    MetaData,
    SmallInteger,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID

from outbox.settings import OutboxSettings

# A high-churn queue table: vacuum it after ~1% of rows changed rather than PostgreSQL's
# default 20%, so dead tuples from deleted (published) rows do not slow the claim scan.
HOT_TABLE_STORAGE = {
    "autovacuum_vacuum_scale_factor": "0.01",
    "autovacuum_vacuum_threshold": "1000",
    "autovacuum_vacuum_insert_scale_factor": "0.05",
    "autovacuum_analyze_scale_factor": "0.02",
    "autovacuum_vacuum_cost_limit": "2000",
    "fillfactor": "90",
}


NOW = text("now()")

# PostgreSQL's own default names, so migrations, metadata and hand-written DDL agree.
NAMING_CONVENTION = {
    "pk": "%(table_name)s_pkey",
    "uq": "%(table_name)s_%(column_0_N_name)s_key",
    "fk": "%(table_name)s_%(column_0_N_name)s_fkey",
    "ck": "%(table_name)s_%(constraint_name)s_check",
    "ix": "%(table_name)s_%(column_0_N_name)s_idx",
}


@dataclass(frozen=True)
class Tables:
    metadata: MetaData
    events: Table  # core: the outbox itself
    failed: Table  # relay: rows Kafka rejected permanently, moved aside
    relays: Table  # relay: live relay processes, their source, lanes and maintenance role
    inbox: Table  # inbox: (consumer, event_id) processed, dead-lettered or skipped
    inbox_attempts: Table  # inbox: durable attempt marker per (consumer, partition)
    dead_letters: Table  # inbox: dead-lettered records, kept for inspection and replay
    inbox_sequences: Table  # inbox: highest applied sequence per (consumer, key)
    consumer_stats: Table  # inbox: events and handler time per (consumer, minute)
    idempotency: Table  # core: idempotent request records (the Stripe pattern)
    effects: Table  # effects: the side-effect ledger, one row per intended external effect

    @property
    def schema(self) -> str | None:
        return self.metadata.schema


def _record_columns() -> list[Column[Any]]:
    """The columns describing one event, shared by the outbox and the failed table
    (a failed row is an outbox row moved aside, column for column)."""
    return [
        Column("event_id", UUID(as_uuid=True), nullable=False, unique=True),
        Column("topic", Text, nullable=False),
        Column("key", LargeBinary, nullable=True),
        Column("lane", SmallInteger, nullable=False),
        Column("event_type", Text, nullable=False),
        Column("source", Text, nullable=False),
        # Both NULL for a tombstone (a null Kafka value: deletes the key when compacted).
        Column("content_type", Text, nullable=True),
        Column("payload", LargeBinary, nullable=True),
        # SHA-256 over topic, key, type and payload: detects a reused event_id.
        Column("fingerprint", LargeBinary, nullable=False),
    ]


def _events(md: MetaData, prefix: str) -> Table:
    name = f"{prefix}events"
    return Table(
        name,
        md,
        # Ordering inside a lane is by id. ids are assigned at INSERT, so a row with a lower
        # id can become visible after a higher one; the relay's claim cursors never pass an
        # id whose writer may still commit (relay/sources/table/cursor.py).
        Column("id", BigInteger, Identity(always=False), primary_key=True),
        *_record_columns(),
        Column("headers", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
        Column("created_at", DateTime(timezone=True), nullable=False, server_default=NOW),
        Column("available_at", DateTime(timezone=True), nullable=False, server_default=NOW),
        Column("attempts", Integer, nullable=False, server_default=text("0")),
        Column("last_error", Text, nullable=True),
        Column("published_at", DateTime(timezone=True), nullable=True),
        Index(
            f"{name}_claim_idx",
            "lane",
            "id",
            postgresql_where=text("published_at IS NULL"),
        ),
        # SQLAlchemy (before 2.1) cannot express table storage parameters: the migration
        # applies them with ALTER TABLE ... SET (set_storage_sql), so does the hook for
        # users' own Alembic (outbox/ops/alembic_env.py), and `outbox doctor` checks them.
        info={"storage": HOT_TABLE_STORAGE},
    )


# ---------------------------------------------------------------- relay section


def _failed(md: MetaData, prefix: str) -> Table:
    return Table(
        f"{prefix}failed",
        md,
        Column("id", BigInteger, primary_key=True),  # the id the row had in events
        *_record_columns(),
        Column("headers", JSONB, nullable=False),
        Column("created_at", DateTime(timezone=True), nullable=False),
        Column("attempts", Integer, nullable=False),
        Column("last_error", Text, nullable=True),
        Column("failed_at", DateTime(timezone=True), nullable=False, server_default=NOW),
    )


def _relays(md: MetaData, prefix: str) -> Table:
    return Table(
        f"{prefix}relays",
        md,
        Column("relay_id", Text, primary_key=True),
        Column("hostname", Text, nullable=False),
        Column("pid", Integer, nullable=False),
        Column("started_at", DateTime(timezone=True), nullable=False, server_default=NOW),
        Column("heartbeat_at", DateTime(timezone=True), nullable=False, server_default=NOW),
        Column("lanes", ARRAY(SmallInteger), nullable=False, server_default=text("'{}'")),
        # Where it reads events (OUTBOX_SOURCE: table or wal), and whether it runs the
        # maintenance services (the one relay holding the maintenance leader's lock).
        Column("source", Text, nullable=False, server_default=text("'table'")),
        Column("maintenance", Boolean, nullable=False, server_default=text("false")),
    )


# ---------------------------------------------------------------- inbox section


def _consumed_record_columns() -> list[Column[Any]]:
    """Which consumer saw which event where: the key and origin shared by the inbox and
    the dead-letter table (one row per consumer and event in each)."""
    return [
        Column("consumer", Text, primary_key=True),
        # The CloudEvents `ce_id`; records without one get "<topic>:<partition>:<offset>".
        Column("event_id", Text, primary_key=True),
        Column("topic", Text, nullable=False),
        Column("partition", Integer, nullable=False),
        Column("offset", BigInteger, nullable=False),
        Column("event_type", Text, nullable=True),
    ]


def _inbox(md: MetaData, prefix: str) -> Table:
    name = f"{prefix}inbox"
    return Table(
        name,
        md,
        *_consumed_record_columns(),
        # processed | dead_lettered | skipped | replaying (a replay is on its way)
        Column("status", Text, nullable=False),
        Column("attempts", Integer, nullable=False, server_default=text("0")),
        Column("last_error", Text, nullable=True),
        Column("received_at", DateTime(timezone=True), nullable=False, server_default=NOW),
        Column("processed_at", DateTime(timezone=True), nullable=True),
        Index(f"{name}_processed_at_idx", "processed_at"),
    )


def _inbox_attempts(md: MetaData, prefix: str) -> Table:
    # One row per (consumer, topic, partition), not per event: "a run over offsets
    # [start_offset, end_offset] started `attempts` times and has not finished". It is
    # committed before handlers run and reset in the run's own commit, so a run that killed
    # the process is visible on restart (see inbox/processor.py).
    return Table(
        f"{prefix}inbox_attempts",
        md,
        Column("consumer", Text, primary_key=True),
        Column("topic", Text, primary_key=True),
        Column("partition", Integer, primary_key=True),
        Column("start_offset", BigInteger, nullable=False),
        Column("end_offset", BigInteger, nullable=False),
        Column("attempts", Integer, nullable=False),
        Column("last_error", Text, nullable=True),
        Column("updated_at", DateTime(timezone=True), nullable=False, server_default=NOW),
    )


def _dead_letters(md: MetaData, prefix: str) -> Table:
    name = f"{prefix}dead_letters"
    return Table(
        name,
        md,
        *_consumed_record_columns(),
        # The original record, byte for byte, so a replay does not depend on the DLQ
        # topic's retention.
        Column("key", LargeBinary, nullable=True),
        Column("value", LargeBinary, nullable=True),
        Column("header_names", ARRAY(Text), nullable=False),
        Column("header_values", ARRAY(LargeBinary), nullable=False),
        Column("error_class", Text, nullable=False),
        Column("error_message", Text, nullable=False),
        Column("attempts", Integer, nullable=False),
        Column("dlq_topic", Text, nullable=False),
        Column("dlq_partition", Integer, nullable=True),
        Column("dlq_offset", BigInteger, nullable=True),
        # Kafka's error when the dead-letter topic refused the record as too large: the
        # record is kept here only, a marker (no value) went to the topic.
        Column("dlq_refused", Text, nullable=True),
        Column("dead_lettered_at", DateTime(timezone=True), nullable=False, server_default=NOW),
        Column("replays", Integer, nullable=False, server_default=text("0")),
        Column("replayed_at", DateTime(timezone=True), nullable=True),
        # Every failed attempt behind the dead letter, replays included (oldest first):
        # outbox/ops/deadletters.py Attempt; capped by inbox/sql.py (capped_history).
        Column("history", JSONB, nullable=False, server_default=text("'[]'::jsonb")),
        Index(f"{name}_dead_lettered_at_idx", "dead_lettered_at"),
    )


def _inbox_sequences(md: MetaData, prefix: str) -> Table:
    # The stale-event guard: the highest ``ce_sequence`` a consumer applied for a key,
    # advanced in the handler's transaction. One small row per key and consumer; kept for
    # as long as an older event of the key could still arrive (a late replay), so forever.
    return Table(
        f"{prefix}inbox_sequences",
        md,
        Column("consumer", Text, primary_key=True),
        Column("key", LargeBinary, primary_key=True),
        Column("sequence", BigInteger, nullable=False),
        Column("updated_at", DateTime(timezone=True), nullable=False, server_default=NOW),
    )


def _consumer_stats(md: MetaData, prefix: str) -> Table:
    # What a consumer group's members did per minute (database clock): events processed,
    # handler seconds, dead letters, retries, duplicates. Each member adds what it counted
    # every few seconds, off the hot path (inbox/stats.py); the console charts the last
    # hour. Rows older than a day are deleted by the members as they write.
    return Table(
        f"{prefix}consumer_stats",
        md,
        Column("consumer", Text, primary_key=True),
        Column("minute", DateTime(timezone=True), primary_key=True),
        Column("processed", BigInteger, nullable=False, server_default=text("0")),
        Column("handler_seconds", Double, nullable=False, server_default=text("0")),
        Column("dead_lettered", BigInteger, nullable=False, server_default=text("0")),
        Column("retries", BigInteger, nullable=False, server_default=text("0")),
        Column("duplicates", BigInteger, nullable=False, server_default=text("0")),
    )


# ---------------------------------------------------------- idempotency section


def _idempotency(md: MetaData, prefix: str) -> Table:
    name = f"{prefix}idempotency_keys"
    return Table(
        name,
        md,
        # scope = principal/tenant + route, so two users' keys never collide.
        Column("scope", Text, primary_key=True),
        Column("key", Text, primary_key=True),
        # SHA-256 (hex) of the canonical request: same key + other payload is a conflict.
        Column("payload_hash", Text, nullable=False),
        Column("status", Text, nullable=False),  # pending | complete | failed
        Column("response_status", Integer, nullable=True),
        # [[name, value], ...] in response order (a header may repeat).
        Column("response_headers", JSONB, nullable=True),
        Column("response_body", LargeBinary, nullable=True),
        Column("created_at", DateTime(timezone=True), nullable=False, server_default=NOW),
        Column("expires_at", DateTime(timezone=True), nullable=False),
        # Lease of the request running the operation; past it, a dead owner is taken over.
        Column("locked_until", DateTime(timezone=True), nullable=True),
        # Which claim owns a pending record; the owner re-checks it before committing.
        Column("lock_token", UUID(as_uuid=True), nullable=True),
        Column("completed_at", DateTime(timezone=True), nullable=True),
        CheckConstraint("status IN ('pending', 'complete', 'failed')", name="status"),
        CheckConstraint("char_length(key) BETWEEN 1 AND 255", name="key_length"),
        Index(f"{name}_expires_at_idx", "expires_at"),
    )


# -------------------------------------------------------------- effects section

EFFECT_STATES = ("pending", "done", "failed", "unknown")


def _effects(md: MetaData, prefix: str) -> Table:
    name = f"{prefix}effects"
    states = ", ".join(f"'{s}'" for s in EFFECT_STATES)
    return Table(
        name,
        md,
        # Derived from the intent (run/step/tool + arguments, or event_id + step), never
        # generated per attempt: every retry at every layer must land on this row.
        Column("key", Text, primary_key=True),
        # SHA-256 (hex) of the canonical arguments: same key + other arguments is a conflict.
        Column("payload_hash", Text, nullable=False),
        Column("state", Text, nullable=False),  # pending | done | failed | unknown
        Column("dependency", Text, nullable=False),
        Column("result", JSONB, nullable=True),  # done: the call's (JSON) result
        Column("error", JSONB, nullable=True),  # failed: {"type", "message", "status"}
        Column("attempts", Integer, nullable=False, server_default=text("0")),
        Column("last_error", Text, nullable=True),  # the latest failed attempt, for operators
        # How long a finished record is kept (and honoured) after it finished.
        Column("dedupe_window", Interval, nullable=False),
        Column("created_at", DateTime(timezone=True), nullable=False, server_default=NOW),
        Column("updated_at", DateTime(timezone=True), nullable=False, server_default=NOW),
        Column("completed_at", DateTime(timezone=True), nullable=True),
        # completed_at + dedupe_window for done/failed; NULL (never expires) otherwise.
        Column("expires_at", DateTime(timezone=True), nullable=True),
        # pending: the claimer's lease; past it (and with no live owner) the next caller
        # reconciles. The token tells the owner it still owns the claim.
        Column("lease_until", DateTime(timezone=True), nullable=True),
        Column("lock_token", UUID(as_uuid=True), nullable=True),
        CheckConstraint(f"state IN ({states})", name="state"),
        CheckConstraint("char_length(key) BETWEEN 1 AND 255", name="key_length"),
        Index(
            f"{name}_expires_at_idx", "expires_at", postgresql_where=text("expires_at IS NOT NULL")
        ),
        Index(f"{name}_state_idx", "state", "updated_at"),
    )


# ------------------------------------------------------------- storage parameters


def hot_tables(tables: Tables) -> list[Table]:
    """The tables that carry storage parameters (``info["storage"]``)."""
    return [t for t in tables.metadata.sorted_tables if t.info.get("storage")]


def storage_differences(table: Table, reloptions: Iterable[str]) -> dict[str, str]:
    """The storage parameters ``table`` should have that its ``pg_class.reloptions``
    (``["fillfactor=90", ...]``) lack or set to another value."""
    have = dict(option.split("=", 1) for option in reloptions)
    want: Mapping[str, str] = table.info.get("storage", {})
    return {k: v for k, v in want.items() if k not in have or float(have[k]) != float(v)}


def set_storage_sql(table: Table, storage: Mapping[str, str]) -> str:
    """``ALTER TABLE "schema"."table" SET (name = value, ...)`` (no trailing semicolon)."""
    settings = ", ".join(f"{k} = {v}" for k, v in storage.items())
    return f"ALTER TABLE {_quoted(table)} SET ({settings})"


def reset_storage_sql(table: Table, names: Iterable[str]) -> str:
    """``ALTER TABLE "schema"."table" RESET (name, ...)``: back to PostgreSQL's defaults."""
    return f"ALTER TABLE {_quoted(table)} RESET ({', '.join(names)})"


def _quoted(table: Table) -> str:
    return str(postgresql.dialect().identifier_preparer.format_table(table))  # type: ignore[no-untyped-call]


@cache
def _build(schema: str, prefix: str) -> Tables:
    md = MetaData(schema=schema, naming_convention=NAMING_CONVENTION)
    return Tables(
        metadata=md,
        events=_events(md, prefix),
        failed=_failed(md, prefix),
        relays=_relays(md, prefix),
        inbox=_inbox(md, prefix),
        inbox_attempts=_inbox_attempts(md, prefix),
        dead_letters=_dead_letters(md, prefix),
        inbox_sequences=_inbox_sequences(md, prefix),
        consumer_stats=_consumer_stats(md, prefix),
        idempotency=_idempotency(md, prefix),
        effects=_effects(md, prefix),
    )


def build_tables(settings: OutboxSettings) -> Tables:
    """The tables for ``settings.db_schema`` / ``settings.table_prefix`` (cached)."""
    return _build(settings.db_schema, settings.table_prefix)
