"""Property: whatever fields ``publish`` is given, it refuses them with a typed error
(:class:`~outbox.PayloadError`, naming the field) or the event arrives intact — in the
outbox table (real PostgreSQL) or, in WAL mode, in a logical replication slot, read back
and decoded as the relay does. Never a raw TypeError, DataError, struct.error or
UnicodeEncodeError, and a refused event leaves the caller's transaction usable."""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import event, example, given
from hypothesis import strategies as st
from sqlalchemy import Connection, Engine, text

from outbox import Message, Outbox, PayloadError
from outbox.envelope import RESERVED_HEADERS, encode_payload
from outbox.pgoutput import message as pg_message
from outbox.settings import OutboxSettings
from outbox.wal_codec import WalEvent, decode
from tests.support.tables import own_tables
from tests.support.wal import wal_source

pytestmark = pytest.mark.integration

# Text as hostile callers write it: any code point, lone surrogates, NUL and newlines
# often, and now and then something that is not text at all.
HOSTILE_CHARS = st.one_of(
    st.characters(codec=None, exclude_categories=()),
    st.sampled_from(["\x00", "\n", "\ud800", "\udfff", "é", "\N{GRINNING FACE}", "\x7f"]),
)
HOSTILE_TEXT = st.text(HOSTILE_CHARS, max_size=40)
# Text every column and header can carry: any code point but NUL and the surrogates.
TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=40)
NAME = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=40)
NOT_TEXT = st.one_of(st.none(), st.integers(), st.binary(max_size=8), st.floats())


def json_values(text: st.SearchStrategy[str], floats: st.SearchStrategy[float]) -> Any:
    leaf = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        floats,
        text,
    )
    return st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)
        ),
        max_leaves=12,
    )


FINITE = st.floats(allow_nan=False, allow_infinity=False)
VALID: dict[str, st.SearchStrategy[Any]] = {
    "topic": st.from_regex(r"[A-Za-z0-9._-]{1,40}", fullmatch=True).filter(
        lambda t: t not in {".", ".."}
    ),
    "event_type": NAME,
    "payload": st.one_of(
        st.binary(max_size=64),
        st.dictionaries(TEXT, json_values(TEXT, FINITE), max_size=4),
        st.lists(json_values(TEXT, FINITE), max_size=3),
    ),
    "key": st.one_of(st.none(), st.binary(max_size=16), TEXT),
    "headers": st.dictionaries(
        NAME.filter(lambda n: n.lower() not in RESERVED_HEADERS), TEXT, max_size=4
    ),
    "source": st.one_of(st.none(), TEXT),
    "event_id": st.one_of(st.none(), st.uuids(), st.uuids().map(str)),
    "delay_seconds": st.one_of(st.just(0), st.floats(min_value=0, max_value=1e6)),
    "sequence": st.none(),
}
HOSTILE: dict[str, st.SearchStrategy[Any]] = {
    "topic": st.one_of(HOSTILE_TEXT, st.from_regex(r"[a-z]{1,10}\n", fullmatch=True), NOT_TEXT),
    "event_type": st.one_of(HOSTILE_TEXT, st.text(min_size=256, max_size=300), NOT_TEXT),
    "payload": st.one_of(
        NOT_TEXT,
        st.text(),
        st.dictionaries(HOSTILE_TEXT, json_values(HOSTILE_TEXT, st.floats()), max_size=4),
    ),
    "key": st.one_of(HOSTILE_TEXT, st.integers(), st.binary().map(bytearray)),
    "headers": st.one_of(
        st.dictionaries(HOSTILE_TEXT, HOSTILE_TEXT, max_size=3),
        st.dictionaries(st.sampled_from(sorted(RESERVED_HEADERS)), TEXT, min_size=1, max_size=1),
        st.dictionaries(TEXT, NOT_TEXT, min_size=1, max_size=2),
        NOT_TEXT,
        st.lists(st.tuples(TEXT, TEXT), max_size=2),
    ),
    "source": st.one_of(HOSTILE_TEXT, NOT_TEXT, st.integers(65_530, 70_000).map(lambda n: "s" * n)),
    "event_id": st.one_of(HOSTILE_TEXT, st.integers(), st.binary(max_size=16)),
    "delay_seconds": st.one_of(
        st.floats(), st.integers(), st.sampled_from([1e15, -1, math.nan, math.inf]), NOT_TEXT
    ),
    "sequence": st.one_of(st.integers(), st.floats(), st.booleans(), NOT_TEXT),
}


@st.composite
def message_fields(draw: st.DrawFn) -> dict[str, Any]:
    """A valid message with none, one or two of its fields made hostile."""
    fields = {name: draw(valid) for name, valid in VALID.items()}
    for name in draw(st.lists(st.sampled_from(sorted(HOSTILE)), max_size=2, unique=True)):
        fields[name] = draw(HOSTILE[name])
    return fields


FIELDS = message_fields()
# The inputs the issue found raising untyped errors, kept as explicit examples.
ISSUE_EXAMPLES: list[dict[str, Any]] = [
    {"topic": 42},
    {"topic": "orders\n"},
    {"key": "k\ud800"},
    {"event_type": "a\x00b"},
    {"headers": {"h": "v\x00"}},
    {"delay_seconds": math.nan},
    {"delay_seconds": math.inf},
    {"delay_seconds": 1e15},
    {"source": "s" * 70_000},
    {"headers": {"h": "\N{GRINNING FACE}" * 300_000}},
]
BASE: dict[str, Any] = {"topic": "orders", "event_type": "t.created", "payload": {"a": 1}}


def with_examples(test: Any) -> Any:
    for fields in reversed(ISSUE_EXAMPLES):
        test = example(fields={**BASE, **fields})(test)
    return test


@pytest.fixture(scope="module")
def table_outbox(
    base_settings: OutboxSettings, engine: Engine
) -> Iterator[tuple[Outbox, Connection]]:
    settings = own_tables(base_settings)
    with engine.connect() as conn:
        yield Outbox(settings), conn


@pytest.fixture(scope="module")
def wal_outbox(base_settings: OutboxSettings) -> Iterator[tuple[Outbox, psycopg.Connection[Any]]]:
    with (
        wal_source(base_settings) as settings,
        psycopg.connect(settings.libpq_dsn, autocommit=True) as slot,
    ):
        yield Outbox(settings), slot


def _publish(ob: Outbox, conn: Connection, fields: dict[str, Any]) -> uuid.UUID | None:
    """The event id, or None when refused with a typed error (the test fails otherwise)."""
    try:
        message = Message(**fields)
    except TypeError:
        return None  # a missing required field: the dataclass's own error, before publish
    try:
        published = ob.publish_many(conn, [message])[0]
        event("published")
        return published
    except PayloadError as exc:
        assert str(exc)
        event(f"refused: {type(exc).__name__} {exc.field}")
        return None


def _expected(ob: Outbox, fields: dict[str, Any], event_id: uuid.UUID) -> dict[str, Any]:
    key = fields.get("key")
    payload, content_type = encode_payload(fields["payload"])
    return {
        "event_id": str(event_id),
        "topic": fields["topic"],
        "key": key.encode() if isinstance(key, str) else key,
        "event_type": fields["event_type"],
        "source": fields.get("source") or ob.settings.default_source,
        "payload": payload,
        "content_type": content_type,
    }


@with_examples
@given(fields=FIELDS)
def test_publish_in_table_mode_refuses_typed_or_stores_intact(
    table_outbox: tuple[Outbox, Connection], fields: dict[str, Any]
) -> None:
    ob, conn = table_outbox
    events = ob.tables.events.fullname
    with conn.begin() as tx:
        event_id = _publish(ob, conn, fields)
        if event_id is not None:
            row = conn.execute(
                text(
                    f"SELECT event_id::text, topic, key, event_type, source, payload, "
                    f"content_type, headers FROM {events} WHERE event_id = :e"
                ),
                {"e": event_id},
            ).one()
            got = dict(row._mapping)
            headers = got.pop("headers")
            got["key"] = None if got["key"] is None else bytes(got["key"])
            got["payload"] = None if got["payload"] is None else bytes(got["payload"])
            assert got == _expected(ob, fields, event_id)
            assert headers == _user_headers(fields, headers)
        # The transaction is still usable after a refusal.
        assert conn.execute(text("SELECT 1")).scalar() == 1
        tx.rollback()


def _user_headers(fields: dict[str, Any], stored: dict[str, str]) -> dict[str, str]:
    given_headers = dict(fields.get("headers") or {})
    if "ce_sequence" in stored:
        given_headers["ce_sequence"] = stored["ce_sequence"]
    return given_headers


@with_examples
@given(fields=FIELDS)
def test_publish_in_wal_mode_refuses_typed_or_arrives_intact(
    wal_outbox: tuple[Outbox, psycopg.Connection[Any]], engine: Engine, fields: dict[str, Any]
) -> None:
    ob, slot = wal_outbox
    fields = {k: v for k, v in fields.items() if k != "delay_seconds"}  # refused in WAL mode
    with engine.connect() as conn, conn.begin():
        event_id = _publish(ob, conn, fields)
    [event] = _drain(ob, slot) or [None]
    if event_id is None:
        assert event is None
        return
    assert event is not None
    got = {
        "event_id": event.event_id,
        "topic": event.topic,
        "key": event.key,
        "event_type": event.event_type,
        "source": event.source,
        "payload": event.payload,
        "content_type": event.content_type,
    }
    assert got == _expected(ob, fields, event_id)
    assert json.loads(event.headers) == _user_headers(fields, json.loads(event.headers))


def _drain(ob: Outbox, slot: psycopg.Connection[Any]) -> list[WalEvent]:
    """The events the slot decoded since the last call (and consumed from it)."""
    wal = ob.settings.wal
    rows = slot.execute(
        "SELECT data FROM pg_logical_slot_get_binary_changes(%s, NULL, NULL, "
        "'proto_version', '1', 'publication_names', %s, 'messages', 'true')",
        [wal.slot, wal.publication],
    ).fetchall()
    events: list[WalEvent] = []
    for (data,) in rows:
        if bytes(data[:1]) == b"M":
            found = pg_message(data)
            if found.prefix == wal.prefix:
                events.extend(decode(found.content))
    return events
