"""The operator tools' SQL (``outbox lag``, ``doctor``, ``cleanup``), in one place.

Everything here is read-only except the cleanup deletes, and those are built so that no
statement ever locks a whole table: each deletes at most one bounded batch of rows it could
lock right away (``FOR UPDATE SKIP LOCKED``), in its own short transaction, so relays,
consumers and producers never wait on a cleanup run.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Delete,
    Float,
    Select,
    Table,
    TextClause,
    and_,
    bindparam,
    delete,
    func,
    literal_column,
    select,
    text,
    union,
)

from outbox.ops.deadletters import DEAD, INBOX_STATUS
from outbox.tables import Tables

# pg_catalog queries: only bind parameters vary (schema and relation names are values here,
# compared against catalog columns, never spliced into SQL).
_INDEXES = text(
    """
    SELECT c.relname AS name, i.indisvalid AS valid, i.indisready AS ready,
           pg_relation_size(c.oid) AS bytes
    FROM pg_index i
    JOIN pg_class c ON c.oid = i.indexrelid
    JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname = :schema AND c.relname = ANY(:names)
    """
)

_RELOPTIONS = text(
    """
    SELECT c.relname AS name, coalesce(c.reloptions, '{}') AS options
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname = :schema AND c.relname = ANY(:names) AND c.relkind IN ('r', 'p')
    """
)

_TABLE_STATS = text(
    """
    SELECT relname AS name, n_live_tup AS live, n_dead_tup AS dead,
           greatest(last_autovacuum, last_vacuum) AS last_vacuum,
           pg_relation_size(relid) AS table_bytes, pg_indexes_size(relid) AS index_bytes
    FROM pg_stat_user_tables
    WHERE schemaname = :schema AND relname = ANY(:names)
    """
)

# Sessions of this database idle inside a transaction for longer than the threshold. One
# holding an xid or a snapshot pins the xmin horizon: VACUUM cannot remove the dead rows
# the relay leaves behind, and every SKIP LOCKED claim scan walks over them. The query text
# is not returned; it may carry literals nobody should see in a report.
_IDLE_IN_TRANSACTION = text(
    """
    SELECT pid, usename AS "user", application_name AS application,
           host(client_addr) AS client, state,
           extract(epoch FROM now() - state_change)::float8 AS idle_seconds,
           extract(epoch FROM now() - xact_start)::float8 AS transaction_seconds,
           backend_xid IS NOT NULL OR backend_xmin IS NOT NULL AS holds_horizon,
           age(coalesce(backend_xid, backend_xmin)) AS xid_age
    FROM pg_stat_activity
    WHERE datname = current_database()
      AND pid <> pg_backend_pid()
      AND state LIKE 'idle in transaction%'
      AND now() - state_change > make_interval(secs => :threshold)
    ORDER BY state_change
    """
)

# What holds back VACUUM's horizon for this database's tables, oldest first: sessions of
# this database holding an xid or a snapshot (any state: pg_dump and reports are "active"),
# walsenders (hot_standby_feedback), prepared transactions, replication slots with an xmin.
# While one of them is old, the rows relays delete or mark published stay in the table and
# its indexes. Only the first 80 characters of a query are read, never bind parameters
# (which pg_stat_activity does not show); without pg_read_all_stats (or membership in the
# session's role) PostgreSQL hides the state, start time and query of other roles'
# sessions, and those columns are NULL. Plain text without parameters or percent signs:
# the relay runs the same statement through psycopg (relay/sources/table/store.py).
VACUUM_HOLDERS = """
    SELECT h.kind, h.pid, h.name, h.state, h.horizon, age(h.horizon) AS xid_age, h.seconds,
           h.query
    FROM (
      SELECT 'session'::text AS kind, a.pid, a.application_name AS name, a.state,
             coalesce(a.backend_xmin, a.backend_xid) AS horizon,
             extract(epoch FROM now() - a.xact_start)::float8 AS seconds,
             left(a.query, 80) AS query
      FROM pg_stat_activity a
      WHERE (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
        AND a.pid <> pg_backend_pid()
        AND (a.datname = current_database() OR a.backend_type = 'walsender')
      UNION ALL
      SELECT 'prepared', NULL, p.gid, 'prepared', p.transaction,
             extract(epoch FROM now() - p.prepared)::float8, NULL
      FROM pg_prepared_xacts p WHERE p.database = current_database()
      UNION ALL
      SELECT 'slot', s.active_pid, s.slot_name,
             CASE WHEN s.active THEN 'active' ELSE 'inactive' END, s.xmin, NULL, NULL
      FROM pg_replication_slots s WHERE s.xmin IS NOT NULL
    ) h
    ORDER BY age(h.horizon) DESC
"""

_VACUUM_HOLDERS = text(VACUUM_HOLDERS + " LIMIT :limit")

# Transactions holding RowExclusiveLock on the outbox (they inserted, updated or deleted rows of it)
# open for longer than :threshold seconds: the relays' claim horizon cannot pass the ids they took
# (relay/sources/table/cursor.py). Start time and query need pg_read_all_stats for other roles'
# sessions; without it they are not listed.
_OUTBOX_WRITERS = text(
    """
    SELECT a.pid, a.application_name AS application, a.state,
           extract(epoch FROM now() - a.xact_start)::float8 AS seconds,
           left(a.query, 80) AS query
    FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
    WHERE l.locktype = 'relation' AND l.mode = 'RowExclusiveLock' AND l.granted
      AND l.relation = CAST(:table AS regclass)
      AND a.pid <> pg_backend_pid()
      AND now() - a.xact_start > make_interval(secs => :threshold)
    ORDER BY a.xact_start
    """
)

_CLOCK = text("SELECT clock_timestamp() AS db_now")

# TLS of this very connection (a role needs no privilege to see its own backend's row).
_OWN_TLS = text(
    "SELECT ssl, version, cipher FROM pg_catalog.pg_stat_ssl WHERE pid = pg_backend_pid()"
)


# -- the WAL source's publication and slot (outbox/ops/wal_slot.py) -----------------------
# Plain SQL with named parameters only (slot and publication names are values here; the
# one statement that needs an identifier, CREATE PUBLICATION, is built by wal_slot with
# the identifier quoted). The relay may run WAL_SLOT through psycopg with %(slot)s.
# Whether this role may create, read and advance slots (superuser or REPLICATION), and
# its name. The relay runs it through psycopg before streaming (relay/sources/wal/source.py).
WAL_MAY_REPLICATE = """
    SELECT rolsuper OR rolreplication AS may_replicate, rolname AS "user"
      FROM pg_roles WHERE rolname = current_user
"""
WAL_SETTINGS = text(
    f"""
    SELECT current_setting('wal_level') AS wal_level,
           CASE current_setting('max_slot_wal_keep_size') WHEN '-1' THEN -1
                ELSE pg_size_bytes(current_setting('max_slot_wal_keep_size')) END
             AS max_slot_wal_keep_size,
           current_database() AS database, r."user", r.may_replicate,
           has_database_privilege(current_database(), 'CREATE') AS may_publish,
           current_setting('server_version_num')::int AS version_num
      FROM ({WAL_MAY_REPLICATE}) AS r
    """
)

# The slot of that name anywhere on the server (names are server-wide; a slot belongs to
# one database). Byte distances are measured from the current WAL insert position:
# retained = WAL the server keeps for this slot (from restart_lsn), unconfirmed = WAL the
# relay has not confirmed yet (from confirmed_flush_lsn).
WAL_SLOT = """
    SELECT s.slot_name, s.plugin, s.slot_type, s.database, s.active, s.active_pid,
           s.wal_status, s.safe_wal_size,
           s.restart_lsn::text AS restart_lsn,
           s.confirmed_flush_lsn::text AS confirmed_flush_lsn,
           pg_current_wal_lsn()::text AS current_lsn,
           pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::bigint AS retained_bytes,
           pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::bigint
             AS unconfirmed_bytes,
           (to_jsonb(s) ->> 'failover')::bool AS failover,
           (to_jsonb(s) ->> 'synced')::bool AS synced
    FROM pg_replication_slots s WHERE s.slot_name = %(slot)s
"""
# failover and synced (PostgreSQL 17+) read through to_jsonb: NULL before 17, one query for
# every version. synced stays true on a promoted standby for the slots it had synced.
WAL_SLOT_QUERY = text(WAL_SLOT.replace("%(slot)s", ":slot"))

# The WAL relays connected to this database (by their application name, which names the
# relay's process after a space: outbox/ops/wal_slot.py): the one reading the slot holds its
# reader lock (an advisory lock), the others stand by for it.
WAL_READERS = text(
    """
    SELECT a.pid,
           EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.locktype = 'advisory'
                   AND l.granted) AS reading,
           a.application_name
    FROM pg_stat_activity a
    WHERE a.datname = current_database()
      AND (a.application_name = :application
           OR starts_with(a.application_name, :application || ' '))
    ORDER BY a.pid
    """
)

WAL_PUBLICATION = text("SELECT count(*) > 0 FROM pg_publication WHERE pubname = :name")

# Who may emit logical-decoding messages, i.e. write WAL events (issue 51): each signature
# of pg_logical_emit_message (three arguments before 17, four from 17) and whether PUBLIC
# may execute it. PostgreSQL grants it to PUBLIC; function privileges are per database.
WAL_EMIT_PUBLIC = text(
    "SELECT coalesce(bool_or(has_function_privilege('public', p.oid, 'EXECUTE')), false)"
    " FROM pg_proc p WHERE p.proname = 'pg_logical_emit_message'"
    " AND p.pronamespace = 'pg_catalog'::regnamespace"
)

# Waits until every transaction that holds an xid now has ended (the slot's consistent
# point); fails inside a transaction that wrote anything (run it in a transaction alone).
WAL_CREATE_SLOT = text(
    "SELECT lsn::text FROM pg_create_logical_replication_slot(:slot, 'pgoutput')"
)
# PostgreSQL 17+: a failover slot (temporary false, two-phase false, failover true), which
# standbys with sync_replication_slots keep in step, so that it survives a promotion.
WAL_CREATE_FAILOVER_SLOT = text(
    "SELECT lsn::text FROM pg_create_logical_replication_slot(:slot, 'pgoutput', false, false,"
    " true)"
)

# A replication command (a replication connection runs it, not SQL): the flag of a slot
# made without it. It waits while another session streams the slot (wal_slot checks first).
ALTER_FAILOVER_ON = "ALTER_REPLICATION_SLOT {slot} ( FAILOVER true )"

# -- failover (outbox/ops/wal_failover.py, relay/wal_failover.py) -------------------------
# The timeline of the WAL being written: a promotion starts a new one (NULL on a standby,
# which writes none). From the name of the current WAL segment: no privilege needed.
WAL_TIMELINE = """
    SELECT CASE WHEN pg_is_in_recovery() THEN NULL
                ELSE ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int
           END AS timeline
"""
# On the primary: synchronized_standby_slots (NULL before 17) and each physical standby
# streaming from it (its walsender; the physical slot it uses, if any). Without
# pg_read_all_stats, pg_stat_replication hides state and sync_state of others' sessions.
WAL_PRIMARY_FAILOVER = text(
    """
    SELECT current_setting('synchronized_standby_slots', true) AS synchronized_standby_slots,
           current_setting('server_version_num')::int AS version_num,
           pg_is_in_recovery() AS in_recovery,
           coalesce((SELECT json_agg(json_build_object(
                'application_name', r.application_name, 'state', r.state,
                'sync_state', r.sync_state, 'slot', ps.slot_name) ORDER BY r.pid)
              FROM pg_stat_replication r
              LEFT JOIN pg_replication_slots ps ON ps.active_pid = r.pid
              WHERE ps.slot_type IS DISTINCT FROM 'logical'
                AND r.application_name NOT LIKE 'outbox-%'
                AND r.application_name <> 'pg_basebackup'), '[]'::json) AS standbys,
           coalesce((SELECT json_agg(slot_name ORDER BY slot_name) FROM pg_replication_slots
              WHERE slot_type = 'physical'), '[]'::json) AS physical_slots
    """
)
# On a standby: what slot synchronization needs (PostgreSQL 17+), and the slot there.
# primary_conninfo is readable by superusers and pg_read_all_settings only (it may hold a
# password): NULL otherwise.
WAL_STANDBY_FAILOVER = text(
    """
    SELECT pg_is_in_recovery() AS in_recovery,
           current_setting('server_version_num')::int AS version_num,
           current_setting('sync_replication_slots', true) AS sync_replication_slots,
           current_setting('hot_standby_feedback') AS hot_standby_feedback,
           current_setting('primary_slot_name', true) AS primary_slot_name,
           CASE WHEN pg_has_role('pg_read_all_settings', 'USAGE')
                     OR (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
                THEN current_setting('primary_conninfo', true) END AS primary_conninfo,
           (SELECT json_build_object('synced', (to_jsonb(s) ->> 'synced')::bool,
                                     'temporary', s.temporary,
                                     'invalidated', (to_jsonb(s) ->> 'invalidation_reason'),
                                     'confirmed_flush_lsn', s.confirmed_flush_lsn::text)
              FROM pg_replication_slots s WHERE s.slot_name = :slot) AS slot
    """
)

# The lag probe (outbox/ops/wal_slot.py): a temporary copy of the slot, at the same
# confirmed position, is peeked instead of the slot itself (a peek takes the slot, and the
# relay's own reads would fail meanwhile). The first transaction it decodes is the oldest
# one the relay has not confirmed; its BEGIN carries its commit time. Needs REPLICATION.
WAL_PROBE_COPY = text("SELECT pg_copy_logical_replication_slot(:slot, :probe, true)")
WAL_PROBE_PEEK = text(
    """
    SELECT data, clock_timestamp() AS db_now
    FROM pg_logical_slot_peek_binary_changes(:probe, NULL, :n, 'proto_version', '1',
         'publication_names', :publication, 'messages', 'true')
    LIMIT :n
    """
)
WAL_PROBE_DROP = text(
    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = :probe"
)

# `outbox wal setup --recreate-lost`: a lost slot (nobody can stream it) makes way.
WAL_DROP_SLOT = text("SELECT pg_drop_replication_slot(:slot)")

# Switching back to the table (outbox/ops/wal_drain.py): the WAL position now, then how far
# the slot's confirmed position is from it (NULL row: no such slot).
WAL_NOW = text("SELECT pg_current_wal_lsn()::text")
WAL_DRAIN = text(
    """
    SELECT s.confirmed_flush_lsn::text AS confirmed,
           s.wal_status,
           COALESCE(s.confirmed_flush_lsn >= CAST(:target AS pg_lsn), false) AS drained,
           GREATEST(pg_wal_lsn_diff(CAST(:target AS pg_lsn), s.confirmed_flush_lsn), 0)::bigint
             AS behind_bytes
    FROM pg_replication_slots s WHERE s.slot_name = :slot
    """
)


@dataclass(frozen=True)
class OpsStore:
    tables: Tables

    # -- lag ----------------------------------------------------------------------------
    def db_now(self) -> Select[Any]:
        return select(func.now().label("now"))

    @cached_property
    def pending_by_topic(self) -> Select[Any]:
        """Per topic: pending rows, how many are due, age of the oldest due one (seconds).

        Age is measured from ``available_at`` (equal to ``created_at`` unless the producer
        asked for a delay), so a deliberately delayed event does not look like lag.
        """
        e = self.tables.events
        due = e.c.available_at <= func.now()
        return (
            select(
                e.c.topic,
                func.count().label("pending"),
                func.count().filter(due).label("due"),
                func.extract("epoch", func.now() - func.min(e.c.available_at).filter(due)).label(
                    "oldest_age"
                ),
            )
            .where(e.c.published_at.is_(None))
            .group_by(e.c.topic)
        )

    @cached_property
    def published_last_minute(self) -> Select[Any]:
        """Keep-mode only: rows the relay marked published during the last 60 s, per topic."""
        e = self.tables.events
        return (
            select(e.c.topic, func.count().label("published"))
            .where(e.c.published_at >= func.now() - literal_column("interval '60 seconds'"))
            .group_by(e.c.topic)
        )

    @cached_property
    def failed_by_day(self) -> Select[Any]:
        """Rows moved to the failed table per day (database clock) since ``:days`` ago."""
        f = self.tables.failed
        day = func.date_trunc("day", f.c.failed_at).label("day")
        since = func.now() - func.make_interval(0, 0, 0, bindparam("days"))
        return select(day, func.count()).where(f.c.failed_at >= since).group_by(day).order_by(day)

    @cached_property
    def failed_by_topic(self) -> Select[Any]:
        f = self.tables.failed
        return select(f.c.topic, func.count().label("failed")).group_by(f.c.topic)

    @cached_property
    def relays(self) -> Select[Any]:
        r = self.tables.relays
        return select(
            r.c.relay_id,
            r.c.hostname,
            r.c.pid,
            r.c.started_at,
            func.extract("epoch", func.now() - r.c.heartbeat_at).label("heartbeat_age"),
            r.c.lanes,
            r.c.source,
            r.c.maintenance,
        ).order_by(r.c.relay_id)

    @cached_property
    def consumer_names(self) -> Select[Any]:
        """Every consumer name the inbox tables know.

        The inbox is keyed (consumer, event_id) and can hold millions of rows per consumer,
        so its distinct names are read with a recursive skip scan over the primary key
        (one index probe per consumer) instead of a full DISTINCT.
        """
        i = self.tables.inbox
        first = select(func.min(i.c.consumer).label("name")).cte("names", recursive=True)
        nxt = (
            select(i.c.consumer)
            .where(i.c.consumer > first.c.name)
            .order_by(i.c.consumer)
            .limit(1)
            .scalar_subquery()
        )
        names = first.union_all(select(nxt).where(first.c.name.is_not(None)))
        a, d = self.tables.inbox_attempts, self.tables.dead_letters
        return select(
            union(
                select(names.c.name).where(names.c.name.is_not(None)),
                select(a.c.consumer).distinct(),
                select(d.c.consumer).distinct(),
            ).subquery()
        )

    @cached_property
    def consumed_topics(self) -> Select[Any]:
        """Topics consumers read, as the inbox tables know them (attempt markers: one row
        per consumer and partition; dead letters)."""
        a, d = self.tables.inbox_attempts, self.tables.dead_letters
        return select(union(select(a.c.topic), select(d.c.topic)).subquery())

    @cached_property
    def dead_letters_by_consumer(self) -> Select[Any]:
        """Per consumer: dead letters, those never replayed, those still dead (their inbox
        row says dead-lettered: never replayed, or replayed and failed again), those of
        the last hour."""
        d, i = self.tables.dead_letters, self.tables.inbox
        joined = d.outerjoin(i, and_(i.c.consumer == d.c.consumer, i.c.event_id == d.c.event_id))
        return (
            select(
                d.c.consumer,
                func.count().label("total"),
                func.count().filter(d.c.replayed_at.is_(None)).label("not_replayed"),
                func.count().filter(i.c.status == INBOX_STATUS[DEAD]).label("still_dead"),
                func.count()
                .filter(d.c.dead_lettered_at > func.now() - literal_column("interval '1 hour'"))
                .label("last_hour"),
            )
            .select_from(joined)
            .group_by(d.c.consumer)
        )

    @cached_property
    def consumer_minutes(self) -> Select[Any]:
        """The consumer_stats rows since ``:seconds`` ago, with the database's time now."""
        c = self.tables.consumer_stats
        since = func.now() - func.make_interval(0, 0, 0, 0, 0, 0, bindparam("seconds"))
        return (
            select(
                c.c.consumer,
                c.c.minute,
                c.c.processed,
                c.c.handler_seconds,
                c.c.dead_lettered,
                c.c.retries,
                func.now().label("now"),
            )
            .where(c.c.minute >= func.date_trunc("minute", since))
            .order_by(c.c.consumer, c.c.minute)
        )

    # -- doctor -------------------------------------------------------------------------
    indexes: TextClause = _INDEXES
    reloptions: TextClause = _RELOPTIONS
    table_stats: TextClause = _TABLE_STATS
    idle_in_transaction: TextClause = _IDLE_IN_TRANSACTION
    vacuum_holders: TextClause = _VACUUM_HOLDERS
    outbox_writers: TextClause = _OUTBOX_WRITERS
    clock: TextClause = _CLOCK
    own_tls: TextClause = _OWN_TLS

    @cached_property
    def pending_topics(self) -> Select[Any]:
        e = self.tables.events
        return select(e.c.topic).distinct().where(e.c.published_at.is_(None))

    @cached_property
    def pending_total(self) -> Select[Any]:
        e = self.tables.events
        return select(func.count()).where(e.c.published_at.is_(None))

    # -- cleanup ------------------------------------------------------------------------
    def cutoff(self) -> Select[Any]:
        """``now() - :seconds`` on the database clock, fixed once per cleanup run."""
        return select(
            func.now() - bindparam("seconds", type_=Float) * literal_column("interval '1 second'")
        )

    @cached_property
    def events_window(self) -> Select[Any]:
        """The next ``:scan`` ids after ``:after`` (primary-key order): the highest, how
        many, whether all of them were created after ``:cutoff``, how many are due for
        deletion, and the lowest one kept.

        Published rows can only have been published after they were created, so once a
        whole window is younger than the cutoff nothing further along can be due; the walk
        stops there instead of scanning the retained (young) part of the table.
        """
        e = self.tables.events
        window = (
            select(e.c.id, e.c.created_at, e.c.published_at)
            .where(e.c.id > bindparam("after"))
            .order_by(e.c.id)
            .limit(bindparam("scan"))
            .subquery()
        )
        due = window.c.published_at < bindparam("cutoff")
        return select(
            func.max(window.c.id).label("hi"),
            func.count().label("n"),
            func.bool_and(window.c.created_at >= bindparam("cutoff")).label("all_young"),
            func.count().filter(due).label("due"),
            # The lowest id this window keeps (pending, or published after the cutoff): a
            # later run must look at it again, not at anything below it.
            func.min(window.c.id).filter(~due | window.c.published_at.is_(None)).label("kept"),
        )

    @cached_property
    def delete_published(self) -> Delete:
        """Delete the published rows older than ``:cutoff`` with ids in (``:after``, ``:hi``]."""
        e = self.tables.events
        doomed = (
            select(e.c.id)
            .where(
                e.c.id > bindparam("after"),
                e.c.id <= bindparam("hi"),
                e.c.published_at < bindparam("cutoff"),
            )
            .with_for_update(skip_locked=True)
        )
        return delete(e).where(e.c.id.in_(doomed))

    @cached_property
    def count_published(self) -> Select[Any]:
        e = self.tables.events
        return select(func.count()).where(e.c.published_at < bindparam("cutoff"))

    def _ctid_batch(self, table: Table, due: ColumnElement[bool]) -> Delete:
        # ctid = ANY(ARRAY(subquery)) is planned as a TID scan of exactly the locked rows;
        # `ctid IN (subquery)` can turn into a hash join over the whole table.
        ctid: ColumnElement[Any] = literal_column("ctid")
        batch = (
            select(ctid)
            .select_from(table)
            .where(due)
            .limit(bindparam("batch"))
            .with_for_update(skip_locked=True)
        )
        return delete(table).where(ctid == func.any(func.array(batch.scalar_subquery())))

    def _inbox_due(self) -> ColumnElement[bool]:
        return self.tables.inbox.c.processed_at < bindparam("cutoff")

    def _failed_due(self) -> ColumnElement[bool]:
        return self.tables.failed.c.failed_at < bindparam("cutoff")

    @cached_property
    def delete_inbox(self) -> Delete:
        return self._ctid_batch(self.tables.inbox, self._inbox_due())

    @cached_property
    def count_inbox(self) -> Select[Any]:
        return select(func.count()).select_from(self.tables.inbox).where(self._inbox_due())

    @cached_property
    def delete_failed(self) -> Delete:
        return self._ctid_batch(self.tables.failed, self._failed_due())

    @cached_property
    def count_failed(self) -> Select[Any]:
        return select(func.count()).select_from(self.tables.failed).where(self._failed_due())

    @cached_property
    def count_idempotency(self) -> Select[Any]:
        """Expired idempotency records, by the same rule as ``IdempotencyStore.purge_batch``
        (which does the deleting)."""
        k = self.tables.idempotency
        return select(func.count()).select_from(k).where(k.c.expires_at <= func.now())

    def _effects_due(self) -> ColumnElement[bool]:
        # Only finished records: a pending or unknown one is never forgotten (its effect may
        # have happened, and forgetting it would let the key be called again).
        f = self.tables.effects
        return f.c.state.in_(("done", "failed")) & (f.c.expires_at <= func.now())

    @cached_property
    def delete_effects(self) -> Delete:
        """Delete a batch of effect records whose dedupe window has passed."""
        return self._ctid_batch(self.tables.effects, self._effects_due())

    @cached_property
    def count_effects(self) -> Select[Any]:
        return select(func.count()).select_from(self.tables.effects).where(self._effects_due())
