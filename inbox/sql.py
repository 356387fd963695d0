"""The inbox's SQL text. ``inbox/store.py`` runs it; nothing else in ``inbox`` builds
statements.

The hot path's statements (the claim, the attempt marker, the sequence guard) are composed
once per store with ``psycopg.sql`` (:class:`Statements`: schema and table prefix quoted as
identifiers, values always bound), for the store to run on the psycopg connection itself.
The operator statements (dead letters, replay) are SQLAlchemy Core, built here where
several of the store's queries share them (the dead-letter filter, the error groups, the
capped history) and inline in the store's method otherwise: they are rare.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psycopg import sql
from sqlalchemy import Table, Text, and_, case, func, literal_column, or_, select, tuple_
from sqlalchemy.dialects.postgresql import JSONB

from outbox.ops.deadletters import DEAD, INBOX_STATUS, STATES, DeadLetterFilter
from outbox.tables import Tables

# The inbox row's status (a claim's ``status``; outbox/ops/deadletters.py names the states
# operators see for each).
PROCESSED = "processed"
DEAD_LETTERED = "dead_lettered"
REPLAYING = "replaying"

# Attempts a dead letter's history keeps: the first, and the latest after it.
HISTORY_KEPT = 20
_UUID = "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"


def capped_history(history: Any) -> Any:
    """``history`` (a jsonb array) cut to :data:`HISTORY_KEPT` entries: its first entry and
    the latest ones (the first failure is never lost, however many replays follow)."""
    latest: Any = literal_column(f"'$[last - {HISTORY_KEPT - 2} to last]'::jsonpath")
    first = func.jsonb_build_array(history.op("->", return_type=JSONB)(0), type_=JSONB)
    return case(
        (func.jsonb_array_length(history) <= HISTORY_KEPT, history),
        else_=first.op("||")(func.jsonb_path_query_array(history, latest, type_=JSONB)),
    )


def _name(table: Table) -> sql.Identifier:
    return sql.Identifier(table.schema, table.name) if table.schema else sql.Identifier(table.name)


@dataclass(frozen=True)
class Statements:
    """The hot path's statements, composed once per store."""

    claim: bytes
    claim_arm: bytes  # the claim, and (a data-modifying CTE) arming markers
    arm: bytes
    get_marker: bytes
    set_marker: bytes
    finish_marker: bytes
    disarm_marker: bytes
    advance_sequence: bytes
    advance_sequences: bytes

    @classmethod
    def of(cls, tables: Tables) -> Statements:
        inbox, attempts = _name(tables.inbox), _name(tables.inbox_attempts)
        # The events travel as one JSON array of [id, topic, partition, offset, type]
        # rows: the statement text (and a server plan prepared for it) is the same for any
        # number of events, and json.dumps (C) costs a fifth of the client CPU of five
        # arrays adapted by psycopg (~0.7 against ~3 µs per event, plus ~10 µs per array).
        # A row left `replaying` by `outbox dlq replay` counts as new exactly once (see
        # InboxStore.claim).
        claim = sql.SQL(
            'INSERT INTO {inbox} AS i (consumer, event_id, topic, partition, "offset", '
            "event_type, status, attempts, last_error, processed_at) "
            "SELECT %(consumer)s, m->>0, m->>1, (m->>2)::integer, (m->>3)::bigint, m->>4, "
            "%(status)s, %(attempts)s, %(last_error)s, now() "
            "FROM json_array_elements(%(events)s::json) AS m "
            "ON CONFLICT (consumer, event_id) DO UPDATE SET topic = excluded.topic, "
            'partition = excluded.partition, "offset" = excluded."offset", '
            "status = excluded.status, attempts = excluded.attempts, "
            "last_error = excluded.last_error, processed_at = excluded.processed_at "
            "WHERE i.status = {replaying} "
            "RETURNING i.event_id"
        ).format(inbox=inbox, replaying=sql.Literal(REPLAYING))
        upsert = sql.SQL(
            "ON CONFLICT (consumer, topic, partition) DO UPDATE SET "
            "start_offset = excluded.start_offset, end_offset = excluded.end_offset, "
            "attempts = excluded.attempts, last_error = excluded.last_error, "
            "updated_at = excluded.updated_at"
        )
        arm = sql.SQL(
            "INSERT INTO {attempts} (consumer, topic, partition, start_offset, end_offset, "
            "attempts, last_error, updated_at) "
            "SELECT %(consumer)s, a->>0, (a->>1)::integer, (a->>2)::bigint, (a->>3)::bigint, "
            "1, NULL, now() FROM json_array_elements(%(arm)s::json) AS a {upsert}"
        ).format(attempts=attempts, upsert=upsert)
        key = sql.SQL("consumer = %(consumer)s AND topic = %(topic)s AND partition = %(partition)s")
        sequences = _name(tables.inbox_sequences)
        statements = {
            "claim": claim,
            "claim_arm": sql.SQL("WITH marker AS ({arm}) {claim}").format(arm=arm, claim=claim),
            "arm": arm,
            "get_marker": sql.SQL(
                "SELECT start_offset, end_offset, attempts, last_error FROM {attempts} WHERE {key}"
            ).format(attempts=attempts, key=key),
            "set_marker": sql.SQL(
                "INSERT INTO {attempts} (consumer, topic, partition, start_offset, end_offset, "
                "attempts, last_error, updated_at) VALUES (%(consumer)s, %(topic)s, "
                "%(partition)s, %(start)s, %(end)s, %(attempts)s, %(last_error)s, now()) "
                "{upsert}"
            ).format(attempts=attempts, upsert=upsert),
            "finish_marker": sql.SQL(
                "UPDATE {attempts} SET attempts = 0, last_error = NULL, updated_at = now() "
                "WHERE {key} AND attempts <> 0"
            ).format(attempts=attempts, key=key),
            # Only the marker still as this process armed it (one attempt, no error): a
            # member letting go late must not erase the count of the partition's new owner.
            "disarm_marker": sql.SQL(
                "UPDATE {attempts} SET attempts = 0, updated_at = now() WHERE {key} "
                "AND start_offset = %(start)s AND end_offset = %(end)s AND attempts = 1 "
                "AND last_error IS NULL"
            ).format(attempts=attempts, key=key),
            "advance_sequence": sql.SQL(
                "INSERT INTO {sequences} AS s (consumer, key, sequence) "
                "VALUES (%(consumer)s, %(key)s, %(sequence)s) "
                "ON CONFLICT (consumer, key) DO UPDATE SET sequence = excluded.sequence, "
                "updated_at = now() WHERE s.sequence < excluded.sequence RETURNING s.sequence"
            ).format(sequences=sequences),
            # A batch handler's list in one statement (see InboxStore.advance_sequences):
            # each key's highest sequence before it (as of the statement's snapshot), and
            # whether the upsert of the list's highest one changed the row (inserted it, or
            # advanced it from exactly the version that snapshot saw: the xmin check).
            "advance_sequences": sql.SQL(
                "WITH ev AS (SELECT k, q FROM unnest(%(keys)s::bytea[], %(sequences)s::bigint[]) "
                "AS t(k, q)), "
                "snap AS (SELECT key, sequence, xmin FROM {sequences} "
                "WHERE consumer = %(consumer)s AND key IN (SELECT k FROM ev)), "
                "up AS (INSERT INTO {sequences} AS s (consumer, key, sequence) "
                "SELECT %(consumer)s, k, max(q) FROM ev GROUP BY k "
                "ON CONFLICT (consumer, key) DO UPDATE SET sequence = excluded.sequence, "
                "updated_at = now() WHERE s.sequence < excluded.sequence "
                "AND s.xmin = (SELECT snap.xmin FROM snap WHERE snap.key = excluded.key) "
                "RETURNING s.key) "
                "SELECT d.k, snap.sequence, up.key IS NOT NULL "
                "FROM (SELECT DISTINCT k FROM ev) AS d "
                "LEFT JOIN snap ON snap.key = d.k LEFT JOIN up ON up.key = d.k"
            ).format(sequences=sequences),
        }
        return cls(**{name: stmt.as_string(None).encode() for name, stmt in statements.items()})


# ---------------------------------------------------------------- dead letters


def dead_letter_query(tables: Tables, f: DeadLetterFilter) -> Any:
    """The dead letters ``f`` selects, each with its inbox row's status (None: no row)."""
    t, inbox = tables.dead_letters, tables.inbox
    query = select(t, inbox.c.status).select_from(
        t.outerjoin(inbox, and_(inbox.c.consumer == t.c.consumer, inbox.c.event_id == t.c.event_id))
    )
    for col, value in (
        (t.c.consumer, f.consumer),
        (t.c.event_id, f.event_id),
        (t.c.topic, f.topic),
        (t.c.event_type, f.event_type),
        (t.c.error_class, f.error_class),
    ):
        if value is not None:
            query = query.where(col == value)
    if f.before is not None:
        query = query.where(t.c.dead_lettered_at < f.before)
    if f.after is not None:
        query = query.where(t.c.dead_lettered_at >= f.after)
    if f.group is not None:
        query = query.where(func.md5(_group_key(t)) == f.group)
    if f.keys is not None:
        query = query.where(tuple_(t.c.consumer, t.c.event_id).in_(list(f.keys) or [("", "")]))
    if f.state is not None:
        status = INBOX_STATUS.get(f.state)
        query = query.where(
            inbox.c.status.is_(None) if status is None else inbox.c.status == status
        )
    if f.replayable:
        query = query.where(or_(inbox.c.status.is_(None), inbox.c.status != PROCESSED))
    return query


def _frame(dead_letters: Table) -> Any:
    """The first application frame of a dead letter's latest failure ('' if none)."""
    history = dead_letters.c.history
    frame = history.op("->", return_type=JSONB)(-1).op("->>", return_type=Text)("frame")
    return func.coalesce(frame, "")


def _error_pattern(dead_letters: Table) -> Any:
    """The error class and its message with the parts that differ per event blanked:
    UUIDs, then hex ids of 8+ digits, then numbers; cut at 200 characters."""
    t = dead_letters
    message = func.left(t.c.error_message, 200)
    for pattern, blank in (
        (_UUID, "<uuid>"),
        ("\\m(?=[0-9a-fA-F]*[0-9])[0-9a-fA-F]{8,}\\M", "<hex>"),
        ("[0-9]+", "<n>"),
    ):
        message = func.regexp_replace(message, pattern, blank, "g")
    return t.c.error_class + ": " + message


def _group_key(dead_letters: Table) -> Any:
    """What a group's id is the md5 of: the error pattern and the frame."""
    return _error_pattern(dead_letters) + "\n" + _frame(dead_letters)


def dead_letter_groups_query(tables: Tables, f: DeadLetterFilter, limit: int) -> Any:
    """The filtered dead letters grouped by error pattern and frame, largest first: per
    group its id, error class, pattern, frame, count, consumers, first and last time, how
    many were ever replayed and how many of those are dead again, then a count per state
    (STATES)."""
    t, inbox = tables.dead_letters, tables.inbox
    inner = (
        dead_letter_query(tables, f)
        .with_only_columns(
            t.c.consumer,
            t.c.error_class,
            t.c.dead_lettered_at,
            t.c.replays,
            inbox.c.status,
            _error_pattern(t).label("pattern"),
            _frame(t).label("frame"),
        )
        .subquery()
    )
    by_state = [
        func.count().filter(
            inner.c.status.is_(None)
            if INBOX_STATUS.get(state) is None
            else inner.c.status == INBOX_STATUS[state]
        )
        for state in STATES
    ]
    return (
        select(
            func.md5(inner.c.pattern + "\n" + inner.c.frame),
            func.min(inner.c.error_class),
            inner.c.pattern,
            inner.c.frame,
            func.count(),
            func.array_agg(func.distinct(inner.c.consumer)),
            func.min(inner.c.dead_lettered_at),
            func.max(inner.c.dead_lettered_at),
            func.count().filter(inner.c.replays > 0),
            func.count().filter(inner.c.replays > 0, inner.c.status == INBOX_STATUS[DEAD]),
            *by_state,
        )
        .group_by(inner.c.pattern, inner.c.frame)
        .order_by(func.count().desc(), inner.c.pattern, inner.c.frame)
        .limit(limit)
    )
