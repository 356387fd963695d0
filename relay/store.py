"""The relay's SQL, in one place. The relay loop, the lane manager and the operator
commands call these methods; none of them builds a statement.

The hot path talks to psycopg 3 directly instead of going through SQLAlchemy: at tens of
thousands of rows per second the per-row cost of SQLAlchemy's result processing is a
large share of the relay's CPU. Statements are composed with ``psycopg.sql`` so that the
configured schema and table prefix (already validated by the settings) are quoted as
identifiers; values are always bind parameters.

Claiming is two statements per batch, sent together (one round trip, psycopg pipeline):

* :attr:`RelayStore.fence` takes a transaction-level advisory lock (the *fence*) on each
  lane with ``pg_try_advisory_xact_lock`` and records the lanes it won in a
  transaction-local setting. Only the lane owner claims a lane, but ownership can move
  while an old owner's batch is still in flight (a voluntary release, a relay whose lock
  connection died while its claim connection lives on, a lane moving between a relay's
  pipelines). The fence serializes every claim transaction of a lane, so a new owner never
  sends a lane's later rows while an old transaction still holds (and might roll back or
  put back) earlier ones. It is a *try* lock, so a fenced lane is simply skipped this
  round: nothing blocks, no deadlock is possible.

  The fence must be won in a statement *before* the claim, never inside it: a READ
  COMMITTED statement takes its snapshot when it starts, before any of its CTEs run. A
  claim that won the fence in its own first CTE could win it from an old transaction that
  committed after that snapshot. In delete mode the rows that transaction put back are
  new tuples (re-inserted) the snapshot cannot see, while the lane's later rows, committed
  before, are visible: the claim takes row 11 with 6..10 back in the table, and sends a
  key's later event first. (In keep mode the put-back is an UPDATE, and the claim's row
  lock follows the update chain to the restored version — EvalPlanQual — because the old
  version passes its WHERE too.) The take-over statement (:attr:`release_delays`) had the
  hole in both modes: the old versions of rows put back with a delay do not match its
  WHERE, so it never looks at the new ones; they stay delayed and the claim passes them.
  tests/integration/test_relay_fence.py holds a statement in that window and showed each
  of these before the fence had a statement of its own. So the claim, the probe
  and the take-over only touch the lanes the fence statement won, and their snapshots are
  taken with those fences already held: every earlier claim transaction of those lanes has
  ended and all it did is visible to them. In a pipeline the extra statement costs no
  round trip.
* per lane, a LATERAL index scan on (lane, id) WHERE published_at IS NULL takes rows in id
  order with ``FOR UPDATE SKIP LOCKED`` (operator tools never block the relay and vice
  versa), starting after the lane's cursor, so that the dead entries a long-held snapshot
  keeps in the index are not walked again (relay/cursor.py; the probe, run after the claim
  in its transaction, says how far the cursors may move); the outer LIMIT stops scanning
  once the batch is full, and the caller rotates the lane list so every lane gets served.
* a byte budget cuts the picked rows to those whose payloads fit the pipeline's share of
  ``relay.max_inflight_bytes`` (always at least one row), keeping a prefix of every lane,
  so a backlog of large rows cannot claim gigabytes at once (see ``_WITHIN_BUDGET``); rows
  it leaves are still pending to the probe, so the cursors stop below them;
* in delete mode the claim *is* the DELETE (``... RETURNING``): the cheapest way to
  consume a queue row in PostgreSQL (measured ~100k rows/s vs ~85k for SELECT FOR UPDATE
  followed by DELETE by id). Rows Kafka did not acknowledge are put back, with their id,
  by :meth:`RelayStore.restore` in the same transaction before it commits, so "only acked
  rows are removed, in the claiming transaction" still holds. When nothing was acked the
  transaction is simply rolled back.
* with ``keep_published_hours > 0`` the claim is ``UPDATE ... SET published_at = now()``
  and restore clears it again; ``outbox cleanup`` deletes marked rows past retention.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from psycopg import sql

from outbox.ops.store import VACUUM_HOLDERS
from outbox.settings import OutboxSettings

# Column order of a claimed row (see CLAIMED_COLUMNS); the publisher indexes tuples by these.
ID, LANE, TOPIC, KEY, PAYLOAD, CE_ID, EVENT_TYPE, SOURCE, CONTENT_TYPE, HEADERS, CE_TIME = range(11)
ATTEMPTS, FINGERPRINT = 11, 12

ClaimedRow = tuple[Any, ...]
# Payload bytes per statement when claimed rows are put back (see RelayStore.restore_chunks).
RESTORE_CHUNK_BYTES = 4 * 1024 * 1024


def payload_bytes(row: ClaimedRow) -> int:
    """A claimed row's payload size, as the claim's byte budget counts it (a row without
    a payload counts 0, in SQL as here)."""
    payload: bytes | None = row[PAYLOAD]
    return len(payload) if payload is not None else 0


# Session settings of the relay's claim connections. The outbox swings between empty, huge
# and full of dead tuples, so table statistics are usually wrong; the planner then likes a
# bitmap scan + sort per lane, which reads every row of the lane (dead ones included, and a
# bitmap scan never marks them dead in the index) — measured 120 ms for an empty poll after
# a 200k drain. The ordered index scan on (lane, id) WHERE published_at IS NULL is always
# the right plan for these statements: it stops at LIMIT and kills dead index entries as
# it passes, so the next poll is fast. Set by a statement after connecting, not as the
# `options` startup parameter: PgBouncer refuses that one, even in session mode.
CLAIM_SESSION_SETTINGS = b"SET enable_bitmapscan = off; SET enable_seqscan = off"

# The claim's byte budget, a step of its own after the rows are picked and locked: keep the
# picked rows while the payload bytes before each (in id order) are under %(max_bytes)s, so
# the first row always stays and each lane keeps a prefix of its rows (a cut in id order is
# a cut in every lane's id order: per-lane order holds). octet_length() of a TOASTed value
# reads the size from its pointer without fetching the value. The window function sits a
# query level above the row locks (FOR UPDATE is not allowed next to one). Picked rows
# beyond the budget stay locked, unclaimed, until the batch commits.
_WITHIN_BUDGET = sql.SQL(
    "within AS ("
    " SELECT b.id FROM ("
    "  SELECT p.id, sum(p.size) OVER (ORDER BY p.id) - p.size AS before FROM picked p"
    " ) b WHERE b.before < %(max_bytes)s"
    ") "
)

# The lanes whose fence this transaction won in its fence statement (see the module
# docstring): a transaction-local setting, gone at commit or rollback; '' or unset = none.
# Read once per statement: a scalar subquery is an InitPlan (the outer no-op cast keeps
# `= ANY((SELECT ...)::int4[])` the array form, not `= ANY (subquery)`); parsed per lane
# it cost ~100 µs more per claim of 64 lanes.
FENCED_SETTING = "outbox.claim_fenced"
_FENCED_LANES = sql.SQL(
    "(SELECT coalesce(nullif(current_setting({name}, true), ''), '{{}}')::int4[])::int4[]"
).format(name=sql.Literal(FENCED_SETTING))

_CE_TIME = "to_char({t}.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')"


def _returning(alias: str) -> sql.Composed:
    t = sql.Identifier(alias)
    cols = [
        sql.SQL("{}.id").format(t),
        sql.SQL("{}.lane").format(t),
        sql.SQL("{}.topic").format(t),
        sql.SQL("{}.key").format(t),
        sql.SQL("{}.payload").format(t),
        sql.SQL("{}.event_id::text").format(t),
        sql.SQL("{}.event_type").format(t),
        sql.SQL("{}.source").format(t),
        sql.SQL("{}.content_type").format(t),
        sql.SQL("{}.headers::text").format(t),
        sql.SQL(_CE_TIME.replace("{t}", "{}")).format(t),
        sql.SQL("{}.attempts").format(t),
        sql.SQL("{}.fingerprint").format(t),
    ]
    return sql.SQL(", ").join(cols)


def namespaces(settings: OutboxSettings) -> tuple[int, int, int]:
    """Advisory-lock namespaces (lane ownership, relay membership, claim fence).

    Derived from schema and prefix so that two deployments sharing one database never
    contend; kept positive so that they compare equal to ``pg_locks.classid`` (an oid).
    """
    base = zlib.crc32(f"{settings.db_schema}.{settings.table_prefix}".encode()) & 0x0FFFFFFF
    return base | 0x10000000, base | 0x20000000, base | 0x30000000


@dataclass(frozen=True)
class RelayStore:
    settings: OutboxSettings

    # -- names ----------------------------------------------------------------------
    def _table(self, suffix: str) -> sql.Identifier:
        return sql.Identifier(self.settings.db_schema, f"{self.settings.table_prefix}{suffix}")

    @cached_property
    def _events(self) -> sql.Identifier:
        return self._table("events")

    @cached_property
    def _failed(self) -> sql.Identifier:
        return self._table("failed")

    @cached_property
    def _relays(self) -> sql.Identifier:
        return self._table("relays")

    @cached_property
    def _ns(self) -> tuple[int, int, int]:
        return namespaces(self.settings)

    @property
    def keep(self) -> bool:
        return self.settings.relay.keep_published_hours > 0

    # -- claim / acknowledge ----------------------------------------------------------
    @cached_property
    def fence(self) -> bytes:
        """Take the fence of each lane of %(lanes)s that no other transaction holds, and
        record them for the statements that follow in this transaction (:attr:`claim`,
        :attr:`probe`, :attr:`release_delays`). The first statement of every claim
        transaction: see the module docstring for why it cannot be part of the claim.
        Returns one row (the recorded list, as text). Bytes, like :attr:`claim`."""
        return (
            sql.SQL(
                "SELECT set_config({name}, coalesce(array_agg(u.lane), '{{}}')::text, true)"
                " FROM unnest(%(lanes)s::int4[]) AS u(lane)"
                " WHERE pg_try_advisory_xact_lock({fence}, u.lane)"
            )
            .format(name=sql.Literal(FENCED_SETTING), fence=sql.Literal(self._ns[2]))
            .as_bytes(None)
        )

    @cached_property
    def claim(self) -> bytes:
        """Params: lanes (int[] in scan order), after (int8[]: per lane, the cursor the scan
        starts after; see relay/cursor.py), limit, max_bytes. Returns ClaimedRow tuples.
        Claims only lanes whose fence :attr:`fence` won earlier in this transaction.

        Bytes, composed once: psycopg would compose a ``Composed`` again on every execute
        (~5% of the relay's CPU at a steady 1,000 events/s, bench/steady.py)."""
        picked = sql.SQL(
            "WITH fenced AS MATERIALIZED ("
            " SELECT u.lane, u.after FROM unnest(%(lanes)s::int4[], %(after)s::int8[])"
            " AS u(lane, after) WHERE u.lane = ANY({fenced})"
            "), picked AS ("
            " SELECT c.id, c.size FROM fenced f CROSS JOIN LATERAL ("
            "  SELECT e.id, coalesce(octet_length(e.payload), 0) AS size FROM {events} e"
            "  WHERE e.lane = f.lane AND e.id > f.after"
            "  AND e.published_at IS NULL AND e.available_at <= now()"
            "  ORDER BY e.id LIMIT %(limit)s FOR UPDATE SKIP LOCKED"
            " ) c LIMIT %(limit)s"
            "), "
        ).format(fenced=_FENCED_LANES, events=self._events)
        # id = ANY(ARRAY(...)): one primary-key probe per picked row. A join with the
        # picked rows may be planned as a merge join over the whole primary key, which walks
        # every dead entry of a held snapshot even when nothing was picked.
        if self.keep:
            action = sql.SQL(
                "UPDATE {events} d SET published_at = now()"
                " WHERE d.id = ANY(ARRAY(SELECT p.id FROM within p))"
            ).format(events=self._events)
        else:
            action = sql.SQL(
                "DELETE FROM {events} d WHERE d.id = ANY(ARRAY(SELECT p.id FROM within p))"
            ).format(events=self._events)
        claim = picked + _WITHIN_BUDGET + action + sql.SQL(" RETURNING ") + _returning("d")
        return claim.as_bytes(None)

    @cached_property
    def probe(self) -> bytes:
        """Per lane whose fence this transaction holds (won by :attr:`fence`), the lowest id
        in (after, horizon] still pending to it; NULL when there is none. Runs after the
        claim in the claim's transaction: rows it claimed are no longer pending to it.

        Params: lanes, after (as for :attr:`claim`), horizon. Returns (lane, id or NULL).
        Bytes, like :attr:`claim`.
        """
        return (
            sql.SQL(
                "WITH fenced AS MATERIALIZED ("
                " SELECT u.lane, u.after FROM unnest(%(lanes)s::int4[], %(after)s::int8[])"
                " AS u(lane, after) WHERE u.lane = ANY({fenced})"
                ") SELECT f.lane, p.id FROM fenced f LEFT JOIN LATERAL ("
                " SELECT e.id FROM {events} e"
                " WHERE e.lane = f.lane AND e.id > f.after AND e.id <= %(horizon)s"
                " AND e.published_at IS NULL ORDER BY e.id LIMIT 1"
                ") p ON true"
            )
            .format(fenced=_FENCED_LANES, events=self._events)
            .as_bytes(None)
        )

    # -- claim horizon (relay/cursor.py) ---------------------------------------------------
    @cached_property
    def _events_name(self) -> sql.Literal:
        """The qualified table name as a text literal (for ::regclass, resolved on every
        statement so that a re-created table is never confused with the old one)."""
        quoted = ".".join(
            '"' + part.replace('"', '""') + '"'
            for part in (self.settings.db_schema, f"{self.settings.table_prefix}events")
        )
        return sql.Literal(quoted)

    @cached_property
    def last_id(self) -> sql.Composed:
        """First half of a horizon reading: (the last id handed out, 0 before the first;
        whether ids come in order — no per-session cache, counting upwards, no cycling).
        No row when the id column has no sequence."""
        return sql.SQL(
            "SELECT coalesce(pg_sequence_last_value(s.seqrelid), 0),"
            " s.seqcache = 1 AND s.seqincrement > 0 AND NOT s.seqcycle"
            " FROM pg_sequence s WHERE s.seqrelid = pg_get_serial_sequence({table}, 'id')::regclass"
        ).format(table=self._events_name)

    @cached_property
    def writers(self) -> sql.Composed:
        """(virtual transaction, pid) of every transaction holding or awaiting
        RowExclusiveLock on the outbox (fast-path locks included), except relay claim
        transactions: those that hold a claim fence never take an id from the sequence (a
        put-back reuses the row's id), so they cannot commit an id late. Second half of a
        horizon reading: always a later statement than :attr:`last_id`. One read of
        ``pg_locks`` (each reference to the view is a new look at the lock table)."""
        return sql.SQL(
            "WITH l AS MATERIALIZED ("
            " SELECT locktype, mode, classid, virtualtransaction, pid FROM pg_locks"
            " WHERE database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            " AND ((locktype = 'relation' AND mode = 'RowExclusiveLock'"
            " AND relation = {table}::regclass)"
            " OR (locktype = 'advisory' AND classid = {fence} AND objsubid = 2 AND granted))"
            ") SELECT w.virtualtransaction, w.pid FROM l w WHERE w.locktype = 'relation'"
            " AND NOT EXISTS (SELECT 1 FROM l f WHERE f.locktype = 'advisory'"
            " AND f.virtualtransaction = w.virtualtransaction)"
        ).format(table=self._events_name, fence=sql.Literal(self._ns[2]))

    @cached_property
    def sessions(self) -> sql.Composed:
        """(pid, application, state) of the given pids, to name what holds the horizon."""
        return sql.SQL(
            "SELECT pid, application_name, state FROM pg_stat_activity"
            " WHERE pid = ANY(%(pids)s::int4[]) ORDER BY pid"
        ).format()

    @cached_property
    def release_delays(self) -> sql.Composed:
        """Lanes just taken over: rows put back with a delay for an unavailable partition or
        a missing topic (``last_error`` LIKE any of %(held)s) become due now. Params: lanes,
        held. Only lanes whose fence :attr:`fence` won earlier in this transaction (an old
        owner's transaction may still hold one): returns those lanes; the claim that
        follows in the same transaction claims them."""
        return sql.SQL(
            "WITH fenced AS MATERIALIZED ("
            " SELECT u.lane FROM unnest(%(lanes)s::int4[]) AS u(lane)"
            " WHERE u.lane = ANY({fenced})"
            "), due AS ("
            " UPDATE {events} e SET available_at = now() FROM fenced f"
            " WHERE e.lane = f.lane AND e.published_at IS NULL AND e.available_at > now()"
            " AND e.last_error LIKE ANY(%(held)s::text[])"
            ") SELECT lane FROM fenced"
        ).format(fenced=_FENCED_LANES, events=self._events)

    @cached_property
    def restore(self) -> sql.Composed:
        """Put unacknowledged rows back (same id, so the same place in their lane).

        Params: arrays from :meth:`restore_params`.
        """
        if self.keep:
            return sql.SQL(
                "UPDATE {events} e SET published_at = NULL, attempts = u.attempts,"
                " last_error = u.err, available_at = now() + u.delay * interval '1 second'"
                " FROM unnest(%(id)s::int8[], %(attempts)s::int4[], %(err)s::text[],"
                " %(delay)s::float8[]) AS u(id, attempts, err, delay) WHERE e.id = u.id"
            ).format(events=self._events)
        return sql.SQL(
            "INSERT INTO {events} (id, event_id, topic, key, lane, event_type, source,"
            " content_type, payload, headers, fingerprint, created_at, available_at, attempts,"
            " last_error)"
            " SELECT u.id, u.event_id, u.topic, u.key, u.lane, u.event_type, u.source,"
            " u.content_type, u.payload, u.headers, u.fingerprint, u.created_at,"
            " now() + u.delay * interval '1 second', u.attempts, u.err"
            " FROM unnest(%(id)s::int8[], %(event_id)s::uuid[], %(topic)s::text[],"
            " %(key)b::bytea[], %(lane)s::int2[], %(event_type)s::text[], %(source)s::text[],"
            " %(content_type)s::text[], %(payload)b::bytea[], %(headers)s::jsonb[],"
            " %(fingerprint)b::bytea[], %(created_at)s::timestamptz[], %(delay)s::float8[],"
            " %(attempts)s::int4[], %(err)s::text[])"
            " AS u(id, event_id, topic, key, lane, event_type, source, content_type, payload,"
            " headers, fingerprint, created_at, delay, attempts, err)"
        ).format(events=self._events)

    @cached_property
    def move_to_failed(self) -> sql.Composed:
        """Insert rows into the failed table (params as for :attr:`restore`)."""
        return sql.SQL(
            "INSERT INTO {failed} (id, event_id, topic, key, lane, event_type, source,"
            " content_type, payload, headers, fingerprint, created_at, attempts, last_error)"
            " SELECT u.id, u.event_id, u.topic, u.key, u.lane, u.event_type, u.source,"
            " u.content_type, u.payload, u.headers, u.fingerprint, u.created_at, u.attempts,"
            " u.err"
            " FROM unnest(%(id)s::int8[], %(event_id)s::uuid[], %(topic)s::text[],"
            " %(key)b::bytea[], %(lane)s::int2[], %(event_type)s::text[], %(source)s::text[],"
            " %(content_type)s::text[], %(payload)b::bytea[], %(headers)s::jsonb[],"
            " %(fingerprint)b::bytea[], %(created_at)s::timestamptz[], %(attempts)s::int4[],"
            " %(err)s::text[])"
            " AS u(id, event_id, topic, key, lane, event_type, source, content_type, payload,"
            " headers, fingerprint, created_at, attempts, err)"
            # The same event may fail again after an operator retried it: keep the latest.
            " ON CONFLICT (event_id) DO UPDATE SET id = EXCLUDED.id, attempts ="
            " EXCLUDED.attempts, last_error = EXCLUDED.last_error, failed_at = now()"
        ).format(failed=self._failed)

    @cached_property
    def delete_marked(self) -> sql.Composed:
        """Keep mode: remove rows that went to the failed table (param: ids)."""
        return sql.SQL("DELETE FROM {events} WHERE id = ANY(%(id)s::int8[])").format(
            events=self._events
        )

    @classmethod
    def restore_chunks(
        cls,
        rows: Sequence[ClaimedRow],
        attempts: Sequence[int],
        errors: Sequence[str | None],
        delays: Sequence[float],
    ) -> Iterator[dict[str, list[Any]]]:
        """:meth:`restore_params` in pieces of at most ``RESTORE_CHUNK_BYTES`` of payload
        (at least one row each), one statement each: sending the payloads back costs about
        twice their size in the client while a statement is built (psycopg's dump, libpq's
        buffer, which keeps its largest size for the connection's life), so a claim of
        large rows is put back a few megabytes at a time."""
        start, size = 0, 0
        for i, row in enumerate(rows):
            if i > start and size + payload_bytes(row) > RESTORE_CHUNK_BYTES:
                yield cls.restore_params(
                    rows[start:i], attempts[start:i], errors[start:i], delays[start:i]
                )
                start, size = i, 0
            size += payload_bytes(row)
        if start < len(rows):
            yield cls.restore_params(rows[start:], attempts[start:], errors[start:], delays[start:])

    @staticmethod
    def restore_params(
        rows: Sequence[ClaimedRow],
        attempts: Sequence[int],
        errors: Sequence[str | None],
        delays: Sequence[float],
    ) -> dict[str, list[Any]]:
        return {
            "id": [r[ID] for r in rows],
            "event_id": [r[CE_ID] for r in rows],
            "topic": [r[TOPIC] for r in rows],
            "key": [r[KEY] for r in rows],
            "lane": [r[LANE] for r in rows],
            "event_type": [r[EVENT_TYPE] for r in rows],
            "source": [r[SOURCE] for r in rows],
            "content_type": [r[CONTENT_TYPE] for r in rows],
            "payload": [r[PAYLOAD] for r in rows],
            "headers": [r[HEADERS] for r in rows],
            "fingerprint": [r[FINGERPRINT] for r in rows],
            "created_at": [r[CE_TIME] for r in rows],
            "delay": list(delays),
            "attempts": list(attempts),
            "err": list(errors),
        }

    # -- lanes and membership ------------------------------------------------------------
    @cached_property
    def join(self) -> sql.Composed:
        """Session lock marking this connection as a live relay (membership); returns the
        backend pid, which every :attr:`cluster_view` checks."""
        return sql.SQL("SELECT pg_backend_pid(), pg_advisory_lock({ns}, pg_backend_pid())").format(
            ns=sql.Literal(self._ns[1])
        )

    @cached_property
    def cluster_view(self) -> sql.Composed:
        """(live relays, lanes held by anyone, this backend's pid) from pg_locks: no
        heartbeat delay at all."""
        return sql.SQL(
            "SELECT count(DISTINCT pid) FILTER (WHERE classid::int8 = {members}),"
            " coalesce(array_agg(objid::int4) FILTER (WHERE classid::int8 = {lanes}), '{{}}'),"
            " pg_backend_pid()"
            " FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).format(members=sql.Literal(self._ns[1]), lanes=sql.Literal(self._ns[0]))

    @cached_property
    def acquire(self) -> sql.Composed:
        """Try lanes in the given order, stop after %(want)s were won; returns them."""
        return sql.SQL(
            "SELECT u.lane FROM unnest(%(lanes)s::int4[]) AS u(lane)"
            " WHERE pg_try_advisory_lock({ns}, u.lane) LIMIT %(want)s"
        ).format(ns=sql.Literal(self._ns[0]))

    @cached_property
    def release(self) -> sql.Composed:
        return sql.SQL(
            "SELECT pg_advisory_unlock({ns}, u.lane) FROM unnest(%(lanes)s::int4[]) AS u(lane)"
        ).format(ns=sql.Literal(self._ns[0]))

    @cached_property
    def heartbeat(self) -> sql.Composed:
        return sql.SQL(
            "INSERT INTO {relays} (relay_id, hostname, pid, lanes)"
            " VALUES (%(relay_id)s, %(hostname)s, %(pid)s, %(lanes)s::int2[])"
            " ON CONFLICT (relay_id) DO UPDATE SET heartbeat_at = now(), lanes = EXCLUDED.lanes"
        ).format(relays=self._relays)

    @cached_property
    def forget_dead(self) -> sql.Composed:
        """Registry rows of relays silent for %(seconds)s (their locks died with them)."""
        return sql.SQL(
            "DELETE FROM {relays} WHERE heartbeat_at < now() - %(seconds)s * interval '1 second'"
        ).format(relays=self._relays)

    @cached_property
    def leave(self) -> sql.Composed:
        return sql.SQL("DELETE FROM {relays} WHERE relay_id = %(relay_id)s").format(
            relays=self._relays
        )

    @cached_property
    def list_relays(self) -> sql.Composed:
        return sql.SQL(
            "SELECT relay_id, hostname, pid, started_at, heartbeat_at, lanes FROM {relays}"
            " ORDER BY started_at"
        ).format(relays=self._relays)

    # -- observability -----------------------------------------------------------------------
    @cached_property
    def pending_stats(self) -> sql.Composed:
        """Per lane with pending rows above its cursor: (lane, pending rows, age in seconds
        of the oldest by the database clock). Params: lanes, after (as for :attr:`claim`).

        Counting from the cursors keeps this cheap while a snapshot is held (rows at or
        below a cursor are never pending: see :attr:`below_cursors`). Run with sequential
        and bitmap scans off, like the claim: one index range per lane.
        """
        return sql.SQL(
            "SELECT u.lane, c.n, c.age FROM unnest(%(lanes)s::int4[], %(after)s::int8[])"
            " AS u(lane, after) CROSS JOIN LATERAL ("
            " SELECT count(*) AS n, extract(epoch FROM now() - min(e.created_at))::float8 AS age"
            " FROM {events} e WHERE e.lane = u.lane AND e.id > u.after AND e.published_at IS NULL"
            ") c WHERE c.n > 0"
        ).format(events=self._events)

    @cached_property
    def below_cursors(self) -> sql.Composed:
        """The cursors' safety net: per lane, the lowest pending id at or below its cursor
        (none by the rules of relay/cursor.py). Params: lanes, after. Walks every lane from
        its start, dead rows included: run rarely."""
        return sql.SQL(
            "SELECT u.lane, b.id FROM unnest(%(lanes)s::int4[], %(after)s::int8[])"
            " AS u(lane, after) CROSS JOIN LATERAL ("
            " SELECT e.id FROM {events} e WHERE e.lane = u.lane AND e.id <= u.after"
            " AND e.published_at IS NULL ORDER BY e.id LIMIT 1) b"
        ).format(events=self._events)

    INDEX_SCANS_ONLY = b"SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off"

    @cached_property
    def vacuum_stats(self) -> sql.Composed:
        """(dead rows of the outbox, then for the oldest transaction or slot holding back
        VACUUM in this database: pid, transaction id it holds back from, its age in seconds
        when visible to this role)."""
        return sql.SQL(
            "SELECT (SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = {table}::regclass),"
            " h.pid, h.horizon::text, h.seconds"
            " FROM (SELECT 1) one LEFT JOIN ({holders} LIMIT 1) h ON true"
        ).format(table=self._events_name, holders=sql.SQL(VACUUM_HOLDERS))

    # -- failed rows (operator commands) -------------------------------------------------
    @cached_property
    def failed_list(self) -> sql.Composed:
        return sql.SQL(
            "SELECT id, event_id::text, topic, event_type, attempts, last_error, failed_at,"
            " octet_length(payload) FROM {failed}"
            " WHERE (%(topic)s::text IS NULL OR topic = %(topic)s) ORDER BY id LIMIT %(limit)s"
        ).format(failed=self._failed)

    @cached_property
    def failed_count(self) -> sql.Composed:
        return sql.SQL("SELECT count(*) FROM {failed}").format(failed=self._failed)

    @cached_property
    def failed_retry(self) -> sql.Composed:
        """Move failed rows (all when %(ids)s is NULL) back to the outbox, attempts reset.

        They get new ids, in the order of their old ones: they join the head of their lane
        like any new row, so no claim cursor can have passed them (relay/cursor.py).
        Returns the failed-table ids that went back.
        """
        return sql.SQL(
            "WITH moved AS (DELETE FROM {failed}"
            " WHERE %(ids)s::int8[] IS NULL OR id = ANY(%(ids)s::int8[]) RETURNING *),"
            " back AS (INSERT INTO {events} (event_id, topic, key, lane, event_type, source,"
            " content_type, payload, headers, fingerprint, created_at)"
            " SELECT event_id, topic, key, lane, event_type, source, content_type, payload,"
            " headers, fingerprint, created_at FROM moved ORDER BY id"
            " ON CONFLICT DO NOTHING RETURNING event_id)"
            " SELECT m.id FROM moved m JOIN back b USING (event_id)"
        ).format(failed=self._failed, events=self._events)

    @cached_property
    def failed_purge(self) -> sql.Composed:
        """Delete failed rows by id, or older than %(hours)s, or all (both NULL)."""
        return sql.SQL(
            "DELETE FROM {failed} WHERE (%(ids)s::int8[] IS NULL OR id = ANY(%(ids)s::int8[]))"
            " AND (%(hours)s::float8 IS NULL OR failed_at < now() - %(hours)s * interval '1 hour')"
            " RETURNING id"
        ).format(failed=self._failed)
