"""The table source's SQL: claims, lanes, the claim horizon (the statements every source
shares are relay/store.py's). Its pipelines, lane manager and horizon watch call these;
none of them builds a statement.

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
  order with ``FOR UPDATE SKIP LOCKED`` (operator tools never block the relay and vice versa),
  starting after the lane's cursor, so that the dead entries a long-held snapshot keeps in the index
  are not walked again (relay/sources/table/cursor.py; the probe, run after the claim in its
  transaction, says how far the cursors may move); the outer LIMIT stops scanning once the batch is
  full, and the caller rotates the lane list so every lane gets served.
* a byte budget cuts the picked rows to those whose payloads fit the pipeline's share of
  ``relay.max_inflight_bytes`` (always at least one row), keeping a prefix of every lane,
  so a backlog of large rows cannot claim gigabytes at once (see ``_WITHIN_BUDGET``); rows
  it leaves are still pending to the probe, so the cursors stop below them;
* in delete mode the claim *is* the DELETE (``... RETURNING``): the cheapest way to
  consume a queue row in PostgreSQL (cheaper than SELECT FOR UPDATE followed by a DELETE by
  id: docs/performance/relay.md). Rows Kafka did not acknowledge are put back, with their id,
  by :attr:`ClaimStore.restore` in the same transaction before it commits, so "only acked
  rows are removed, in the claiming transaction" still holds. When nothing was acked the
  transaction is simply rolled back.
* with ``keep_published_hours > 0`` the claim is ``UPDATE ... SET published_at = now()``
  and restore clears it again; ``outbox cleanup`` deletes marked rows past retention.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from psycopg import sql

from outbox.settings import OutboxSettings
from outbox.wake import WAKE_SLOTS, trigger_name, wake_channel, wake_namespace
from relay.store import RelayStore, namespaces

# Session settings of the relay's claim connections. The outbox swings between empty, huge and full
# of dead tuples, so table statistics are usually wrong; the planner then likes a bitmap scan + sort
# per lane, which reads every row of the lane (dead ones included, and a bitmap scan never marks
# them dead in the index): an empty poll after a large drain crawls (docs/performance/relay.md). The
# ordered index scan on (lane, id) WHERE published_at IS NULL is always the right plan for these
# statements: it stops at LIMIT and kills dead index entries as it passes, so the next poll is fast.
# Set by a statement after connecting, not as the `options` startup parameter: PgBouncer refuses
# that one, even in session mode.
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
# it costs more per claim (docs/performance/relay.md).
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


@dataclass(frozen=True)
class ClaimStore(RelayStore):
    """The table source's SQL (and the shared statements it inherits)."""

    keep: bool = False  # keep mode (relay.keep_published_hours > 0): claims mark, not delete

    @classmethod
    def of(cls, settings: OutboxSettings) -> ClaimStore:
        return cls(
            settings.db_schema, settings.table_prefix, settings.relay.keep_published_hours > 0
        )

    @cached_property
    def _ns(self) -> tuple[int, int, int]:
        return namespaces(self.schema, self.prefix)

    # -- wake-ups (outbox/wake.py) -----------------------------------------------------
    @cached_property
    def listen(self) -> bytes:
        """Receive the producers' wake-ups on this session (once, at connect)."""
        channel = sql.Identifier(wake_channel(self.schema, self.prefix))
        return sql.SQL("LISTEN {}").format(channel).as_bytes(None)

    @cached_property
    def wake_trigger(self) -> sql.Composed:
        """Whether the outbox table has the wake-up trigger, enabled (migration 0012; a
        schema from users' own Alembic history has none). One row, a boolean."""
        return sql.SQL(
            "SELECT EXISTS (SELECT FROM pg_trigger WHERE tgrelid = {table}::regclass"
            " AND tgname = {name} AND tgenabled <> 'D')"
        ).format(table=self._events_name, name=sql.Literal(trigger_name(self.prefix)))

    @cached_property
    def take_wake_slot(self) -> bytes:
        """A free wake slot for this session, as a session lock: one row (the slot), or
        none when all are taken (the session then polls without a wake-up). Sent after a
        claim that found nothing, followed by :attr:`due`: see outbox/wake.py."""
        return (
            sql.SQL(
                "SELECT s FROM generate_series(0, {last}) AS s"
                " WHERE pg_try_advisory_lock({ns}, s) LIMIT 1"
            )
            .format(
                last=sql.Literal(WAKE_SLOTS - 1),
                ns=sql.Literal(wake_namespace(self.schema, self.prefix)),
            )
            .as_bytes(None)
        )

    @cached_property
    def due(self) -> bytes:
        """Params: lanes, after (as for :attr:`claim`). Whether any row of these lanes is
        due, in a snapshot taken after :attr:`take_wake_slot`: a row committed between the
        empty claim and the slot (its producer saw no slot held, so it did not notify) is
        seen here, and the relay polls instead of waiting for a wake-up. The statement's
        clock, not the transaction's: those rows' ``available_at`` is later than the
        claim's ``now()``. Rows other claims hold count too (the relay then polls)."""
        return (
            sql.SQL(
                "SELECT EXISTS (SELECT FROM unnest(%(lanes)s::int4[], %(after)s::int8[])"
                " AS u(lane, after) CROSS JOIN LATERAL ("
                "  SELECT FROM {events} e WHERE e.lane = u.lane AND e.id > u.after"
                "  AND e.published_at IS NULL AND e.available_at <= statement_timestamp()"
                "  LIMIT 1) c)"
            )
            .format(events=self._events)
            .as_bytes(None)
        )

    @cached_property
    def release_wake_slot(self) -> bytes:
        """Params: slot. Producers stop notifying for this session."""
        return (
            sql.SQL("SELECT pg_advisory_unlock({ns}, %(slot)s::int4)")
            .format(ns=sql.Literal(wake_namespace(self.schema, self.prefix)))
            .as_bytes(None)
        )

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

    # Rows due that the WAL source may publish (relay/sources/wal/table_rows.py): created at
    # or before %(until)s, and with no earlier row of their lane put back for later (a
    # table relay's retry of a partition Kafka did not answer for, a missing topic): the
    # later row must not pass it. Rows delayed at publish hold nothing, as in both sources.
    _TAKEABLE = (
        "{e}.published_at IS NULL AND {e}.available_at <= now() AND {e}.created_at <= %(until)s"
        " AND NOT EXISTS (SELECT 1 FROM {events} b WHERE b.lane = {e}.lane AND b.id < {e}.id"
        " AND b.published_at IS NULL AND b.available_at > now()"
        " AND NOT (b.attempts = 0 AND b.last_error IS NULL AND b.available_at > b.created_at))"
    )

    @cached_property
    def lanes_takeable(self) -> sql.Composed:
        """The lanes that hold rows the WAL source may publish (see ``_TAKEABLE``): the
        only fences it takes."""
        return sql.SQL("SELECT DISTINCT e.lane FROM {events} e WHERE {takeable}").format(
            events=self._events,
            takeable=sql.SQL(self._TAKEABLE).format(e=sql.Identifier("e"), events=self._events),
        )

    @cached_property
    def any_takeable(self) -> sql.Composed:
        """Whether the table has a row the WAL source may publish (``_TAKEABLE``): whether
        a hold point would publish anything (relay/sources/wal/reading.py)."""
        return sql.SQL("SELECT EXISTS (SELECT 1 FROM {events} e WHERE {takeable})").format(
            events=self._events,
            takeable=sql.SQL(self._TAKEABLE).format(e=sql.Identifier("e"), events=self._events),
        )

    @cached_property
    def take_created_until(self) -> sql.Composed:
        """The WAL source publishing the table's rows itself (relay/sources/wal/
        table_rows.py): up to %(limit)s rows of ``_TAKEABLE``, of the lanes whose fence
        :attr:`fence` won earlier in this transaction, in id order within %(max_bytes)s;
        claimed (deleted or marked) as :attr:`claim` claims, returning events. Without the
        lanes' cursors: the WAL relay owns no lane, and its rows are few (a stray publish,
        the tail of a switch)."""
        picked = sql.SQL(
            "WITH picked AS ("
            " SELECT e.id, coalesce(octet_length(e.payload), 0) AS size FROM {events} e"
            " WHERE e.lane = ANY({fenced}) AND {takeable}"
            " ORDER BY e.id LIMIT %(limit)s FOR UPDATE SKIP LOCKED"
            "), "
        ).format(
            fenced=_FENCED_LANES,
            events=self._events,
            takeable=sql.SQL(self._TAKEABLE).format(e=sql.Identifier("e"), events=self._events),
        )
        return picked + _WITHIN_BUDGET + self._claimed + sql.SQL(" RETURNING ") + _returning("d")

    @cached_property
    def delete_moved(self) -> sql.Composed:
        """Keep mode: the rows of %(ids)s that went to the failed table meanwhile (their
        event ids are there) are deleted, not left marked published."""
        return sql.SQL(
            "DELETE FROM {events} d WHERE d.id = ANY(%(ids)s::int8[])"
            " AND EXISTS (SELECT 1 FROM {failed} f WHERE f.event_id = d.event_id)"
        ).format(events=self._events, failed=self._failed)

    @cached_property
    def _claimed(self) -> sql.Composed:
        """What claiming the rows of ``within`` does: marks them published (keep mode) or
        deletes them."""
        if self.keep:
            return sql.SQL(
                "UPDATE {events} d SET published_at = now()"
                " WHERE d.id = ANY(ARRAY(SELECT p.id FROM within p))"
            ).format(events=self._events)
        return sql.SQL(
            "DELETE FROM {events} d WHERE d.id = ANY(ARRAY(SELECT p.id FROM within p))"
        ).format(events=self._events)

    @cached_property
    def claim(self) -> bytes:
        """Params: lanes (int[] in scan order), after (int8[]: per lane, the cursor the scan
        starts after; see relay/sources/table/cursor.py), limit, max_bytes. Returns events
        (relay/event.py). Claims only lanes whose fence :attr:`fence` won earlier in this
        transaction.

        Bytes, composed once: psycopg would compose a ``Composed`` again on every execute
        (a share of the relay's CPU worth saving: docs/performance/relay.md)."""
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
        # id = ANY(ARRAY(...)) in _claimed: one primary-key probe per picked row. A join
        # with the picked rows may be planned as a merge join over the whole primary key,
        # which walks every dead entry of a held snapshot even when nothing was picked.
        claim = picked + _WITHIN_BUDGET + self._claimed + sql.SQL(" RETURNING ") + _returning("d")
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

    # -- claim horizon (relay/sources/table/cursor.py) --------------------------------
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
    def delete_marked(self) -> sql.Composed:
        """Keep mode: remove rows that went to the failed table (param: ids)."""
        return sql.SQL("DELETE FROM {events} WHERE id = ANY(%(id)s::int8[])").format(
            events=self._events
        )

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
        (none by the rules of relay/sources/table/cursor.py). Params: lanes, after. Walks
        every lane from its start, dead rows included: run rarely."""
        return sql.SQL(
            "SELECT u.lane, b.id FROM unnest(%(lanes)s::int4[], %(after)s::int8[])"
            " AS u(lane, after) CROSS JOIN LATERAL ("
            " SELECT e.id FROM {events} e WHERE e.lane = u.lane AND e.id <= u.after"
            " AND e.published_at IS NULL ORDER BY e.id LIMIT 1) b"
        ).format(events=self._events)

    INDEX_SCANS_ONLY = b"SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off"
