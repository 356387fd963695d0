"""Property: whatever a Kafka record carries — any bytes in the key, the value and header
values, NUL or bytes that are not UTF-8 in header names, repeated and oversized headers,
ids and types with NUL bytes, invalid UTF-8 or too long, structured CloudEvents with
escaped NULs and lone surrogates —
`outbox consume` (a subprocess, real PostgreSQL and Kafka) applies it or dead-letters it
with its bytes, the partition moves on, and the daemon never exits.

One consumer runs for the whole module; each example produces its records with a raw
aiokafka producer, then a sentinel record behind them on the same partition: once the
sentinel is applied, every record before it has been settled."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from hypothesis import example, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from sqlalchemy import Engine, text

from outbox.settings import OutboxSettings
from tests.support.inbox import ROOT, effects_table, subprocess_env
from tests.support.kafka import create_topic
from tests.support.raw_headers import RawName, raw_name_builders

pytestmark = pytest.mark.integration

Headers = list[tuple[str, bytes]]
_COUNTER = itertools.count()

RAW = st.one_of(
    st.binary(max_size=40),
    st.text(st.characters(codec="utf-8"), max_size=20).map(str.encode),
    st.sampled_from([b"", b"\x00", b"a\x00b", b"\xff\xfe", b"\xed\xa0\x80", b"\xc0\x80"]),
)
# Header names are text in Kafka's protocol: aiokafka sends any code point but surrogates.
# A foreign client may send any bytes (RawName: sent as they are; aiokafka's reader used to
# fail every fetch of the partition on one that is not UTF-8).
NAME = st.one_of(
    st.sampled_from(["ce_id", "ce_type", "ce_source", "ce_sequence", "content-type", "ce_time"]),
    st.text(st.characters(codec="utf-8"), max_size=12),
    st.binary(min_size=1, max_size=8).map(RawName),
)
TYPES = st.one_of(st.sampled_from([b"test.event", b"test.batch", b"test.unknown"]), RAW)
IDS = st.one_of(st.just(b""), RAW, st.binary(min_size=250, max_size=300))
HOSTILE_TEXT = st.text(
    st.one_of(st.characters(codec="utf-8"), st.sampled_from(["\x00", "\ud800", "\udfff"])),
    max_size=12,
)


@dataclass(frozen=True)
class Shape:
    """What the strategy drew; the test makes each record's id unique (a suffix)."""

    key: bytes | None
    value: bytes | None
    ce_id: bytes | None  # None: no ce_id header
    ce_type: bytes | None
    extra: tuple[tuple[str, bytes], ...]
    structured: dict[str, Any] | None  # a structured-mode event instead of binary headers


BINARY = st.builds(
    Shape,
    key=st.one_of(st.none(), RAW),
    value=st.one_of(st.none(), RAW, st.just(b'{"a":1}')),
    ce_id=st.one_of(st.none(), IDS),
    ce_type=st.one_of(st.none(), TYPES),
    extra=st.lists(st.tuples(NAME, RAW), max_size=5).map(tuple)
    | st.just((("big", b"x" * 100_000), ("big", b"y"))),
    structured=st.none(),
)
STRUCTURED = st.builds(
    Shape,
    key=st.one_of(st.none(), RAW),
    value=st.none(),
    ce_id=st.none(),
    ce_type=st.none(),
    extra=st.just(()),
    structured=st.fixed_dictionaries(
        {
            "id": HOSTILE_TEXT,
            "type": st.one_of(st.sampled_from(["test.event", "test.batch"]), HOSTILE_TEXT),
        },
        optional={"data": st.one_of(HOSTILE_TEXT, st.integers()), "source": HOSTILE_TEXT},
    ),
)
SHAPES = st.lists(st.one_of(BINARY, BINARY, STRUCTURED), min_size=1, max_size=10)


def _record(shape: Shape) -> tuple[bytes | None, bytes | None, Headers]:
    suffix = f"-{next(_COUNTER)}-{uuid.uuid4().hex[:6]}"
    if shape.structured is not None:
        doc = {"specversion": "1.0", "source": "urn:x", **shape.structured}
        doc["id"] += suffix
        value = json.dumps(doc).encode()  # lone surrogates and NULs become \u escapes
        return shape.key, value, [("content-type", b"application/cloudevents+json")]
    headers: Headers = [("ce_specversion", b"1.0"), ("ce_source", b"urn:x")]
    if shape.ce_id is not None:
        headers.append(("ce_id", shape.ce_id + suffix.encode()))
    if shape.ce_type is not None:
        headers.append(("ce_type", shape.ce_type))
    for name, raw in shape.extra:
        headers.append((name, raw + suffix.encode() if name == "ce_id" else raw))
    # aiokafka sends no record without a key or a value (Kafka itself would take it).
    value = b"" if shape.key is None and shape.value is None else shape.value
    return shape.key, value, headers


@dataclass(repr=False)
class Running:
    topic: str
    group: str
    table: str
    settings: OutboxSettings
    engine: Engine
    bootstrap: str
    process: subprocess.Popen[bytes]
    log: Path

    def __repr__(self) -> str:
        return f"Running(topic={self.topic!r}, group={self.group!r})"

    def settle(self, offset: int) -> None:
        """Wait until the record at ``offset`` (a sentinel) is applied."""
        deadline = asyncio.get_event_loop_policy().get_event_loop().time() + 60
        loop = asyncio.get_event_loop_policy().get_event_loop()
        while offset not in self.applied():
            assert self.process.poll() is None, f"the consumer exited: {self.stderr()}"
            assert loop.time() < deadline, f"record {offset} not applied within 60 s"
            loop.run_until_complete(asyncio.sleep(0.05))

    def applied(self) -> dict[int, str]:
        with self.engine.connect() as conn:
            rows = conn.execute(text(f"SELECT seq, event_id FROM {self.table}"))
            return {r[0]: r[1] for r in rows}

    def dead_letters(self) -> dict[int, tuple[Any, ...]]:
        table = f'"{self.settings.db_schema}"."{self.settings.table_prefix}dead_letters"'
        with self.engine.connect() as conn:
            rows = conn.execute(
                text(
                    f'SELECT "offset", key, value, header_values FROM {table} '
                    "WHERE consumer = :c AND topic = :t"
                ),
                {"c": self.group, "t": self.topic},
            )
            return {
                r[0]: (
                    None if r[1] is None else bytes(r[1]),
                    None if r[2] is None else bytes(r[2]),
                    [bytes(v) for v in r[3]],
                )
                for r in rows
            }

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")[-5000:]


@pytest.fixture(scope="module")
def running(
    base_settings: OutboxSettings, engine: Engine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Running]:
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    bootstrap = base_settings.kafka_bootstrap_servers
    topic = loop.run_until_complete(create_topic(bootstrap, f"fuzz-{uuid.uuid4().hex[:10]}"))
    group = f"fuzz-{uuid.uuid4().hex[:8]}"
    table = effects_table(engine)
    env = subprocess_env(
        base_settings,
        INBOX_TEST_CONSUMER=group,
        INBOX_TEST_TOPIC=topic,
        INBOX_TEST_EFFECTS=table,
        OUTBOX_CONSUMER__UNKNOWN_TYPE_POLICY="dead_letter",
    )
    # Its log goes to a file: a pipe nobody reads fills up and blocks the daemon's writes.
    log = tmp_path_factory.mktemp("fuzz") / "consumer.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            ["outbox", "consume", "tests.support.hostile_apps:app"],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    run = Running(topic, group, table, base_settings, engine, bootstrap, process, log)
    try:
        yield run
        assert process.poll() is None, f"the consumer exited: {run.stderr()}"
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        code = process.wait(60)
        loop.close()
    assert code == 0, run.stderr()


async def _produce(bootstrap: str, topic: str, records: list[Any]) -> list[int]:
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", linger_ms=5, max_request_size=4_000_000
    )
    await producer.start()
    try:
        with raw_name_builders():
            futures = [
                await producer.send(topic, value, key=key, headers=headers, partition=0)
                for key, value, headers in records
            ]
            return [(await f).offset for f in futures]
    finally:
        await producer.stop()


SENTINEL = Shape(None, b"{}", b"sentinel", b"test.event", (), None)


@example(
    shapes=[
        Shape(b"k", b"{}", b"a\x00b", b"test.event", (), None),  # the ce_id
        Shape(b"k", b"{}", b"id", b"test.\x00event", (), None),  # the ce_type
        Shape(b"k\x00", b"{}", b"id", b"test.event", (("ce_source", b"\x00"),), None),
        Shape(b"k", b"{}", b"id", b"test.batch", (("h\x00", b"\x00\xff"),), None),
        Shape(None, None, None, None, (), {"id": "\x00", "type": "test.event"}),
        Shape(None, None, None, None, (), {"id": "x", "type": "\ud800"}),
        Shape(b"k", b"{}", b"id", b"test.event", ((RawName(b"\xff\xfe"), b"v"),), None),
    ]
)
@given(shapes=SHAPES)
# A fifth of the profile's examples (tests/conftest.py): each costs a produce and a wait.
@hypothesis_settings(max_examples=max(10, hypothesis_settings.default.max_examples // 5))
def test_every_record_is_applied_or_dead_lettered_with_its_bytes(
    running: Running, shapes: list[Shape]
) -> None:
    records = [_record(s) for s in [*shapes, SENTINEL]]
    loop = asyncio.get_event_loop_policy().get_event_loop()
    offsets = loop.run_until_complete(_produce(running.bootstrap, running.topic, records))
    running.settle(offsets[-1])
    applied, dead = running.applied(), running.dead_letters()
    for offset, (key, value, headers) in zip(offsets[:-1], records[:-1], strict=True):
        assert (offset in applied) != (offset in dead), (offset, key, value, headers)
        if offset in dead:
            assert dead[offset] == (key, value, [v for _, v in headers])
        else:
            ids = [v for n, v in headers if n == "ce_id"]
            if ids:  # binary mode: the id is the last ce_id header, exactly
                assert applied[offset].encode() == ids[-1]
