"""The Kafka room (outbox/kafka/aiokafka_internals.py): aiokafka's private names appear nowhere
else, each capability is checked against the installed aiokafka, and a lost one is said once at
WARNING and falls back instead of failing. The room's internals against a real broker:
tests/integration/test_kafka_canary.py."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import aiokafka
import aiokafka.conn
import aiokafka.protocol.metadata
import pytest
from aiokafka.client import AIOKafkaClient
from aiokafka.consumer import fetcher
from aiokafka.producer.message_accumulator import MessageAccumulator
from aiokafka.record import default_records, memory_records
from aiokafka.structs import TopicPartition

from outbox.kafka import aiokafka_internals, aiokafka_records
from outbox.kafka.client import UndecodedHeader
from tests.support import oauth_tokens
from tests.support.raw_headers import RawName

ROOT = Path(__file__).resolve().parents[2]
# aiokafka's private names the project uses, and the private attributes behind them.
PRIVATE = re.compile(
    r"\._client\b|\._fetcher\b|_message_accumulator|get_random_node|_send_request"
    r"|OAuthAuthenticator|MetadataRequest|_fetch_min_bytes|_fetch_max_wait_ms"
    r"|_pending_batches|\bfail_all\b|\._coordinator\b|reset_generation|kafka_errors\["
    r"|_DefaultRecord\w*Py\b|\b_read_msg\b|fetcher\.MemoryRecords\b"
)
# The room, and the tests that exercise it against aiokafka.
ROOM = {
    "outbox/kafka/aiokafka_internals.py",
    "outbox/kafka/aiokafka_records.py",  # the room's lenient record reader
    "tests/unit/test_aiokafka_internals.py",
    "tests/integration/test_kafka_canary.py",
    "tests/unit/test_membership.py",  # a fake of the consumer's coordinator
    "tests/support/raw_headers.py",  # a producer of header names that are not UTF-8
}
SOURCES = ("outbox", "relay", "inbox", "cli", "bench", "examples", "tests", "scripts")


def test_aiokafka_internals_are_used_in_the_kafka_room_only() -> None:
    found = []
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name in ROOM or ".venv" in path.parts:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if PRIVATE.search(line):
                    found.append(f"{name}:{number}: {line.strip()}")
    assert not found, (
        "aiokafka internals outside outbox/kafka/aiokafka_internals.py:\n" + "\n".join(found)
    )


def test_the_grep_would_see_them() -> None:
    # The pattern itself can fail: each name the issue lists is matched.
    for line in (
        "kafka._client",
        "consumer._fetcher._fetch_min_bytes",
        "p._message_accumulator",
        "c.get_random_node = f",
        "admin._send_request(r, n)",
        "aiokafka.conn.OAuthAuthenticator",
        "records._DefaultRecordBatchPy",
        "fetcher.MemoryRecords = _LenientRecords",
    ):
        assert PRIVATE.search(line), line


@pytest.fixture
def room() -> Iterator[None]:
    """A fresh check before and after (the verdict is cached per process)."""
    aiokafka_internals.check(again=True)
    yield
    aiokafka_internals.check(again=True)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "outbox.kafka" and r.levelno == logging.WARNING]


def test_this_aiokafka_has_every_capability(room: None, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="outbox.kafka")
    assert aiokafka_internals.check(again=True) == {}
    assert _warnings(caplog) == []
    assert all(aiokafka_internals.usable(c) for c in aiokafka_internals.CAPABILITIES)


@pytest.mark.parametrize(
    ("owner", "name", "capability", "says"),
    [
        (
            AIOKafkaClient,
            "get_random_node",
            aiokafka_internals.BROKER_CHOICE,
            "hung-broker failover",
        ),
        (
            aiokafka.protocol.metadata,
            "MetadataRequest",
            aiokafka_internals.METADATA,
            "leader watch",
        ),
        (MessageAccumulator, "fail_all", aiokafka_internals.ABANDON, "ack timeout"),
        (aiokafka.conn, "OAuthAuthenticator", aiokafka_internals.OAUTH_EXCHANGE, "OAUTHBEARER"),
        (
            default_records,
            "_DefaultRecordBatchPy",
            aiokafka_internals.HEADER_NAMES,
            "header name is not UTF-8 stops the consumer",
        ),
    ],
)
def test_a_vanished_internal_is_one_warning_naming_the_version_and_what_is_lost(
    room: None,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    owner: object,
    name: str,
    capability: aiokafka_internals.Capability,
    says: str,
) -> None:
    caplog.set_level(logging.WARNING, logger="outbox.kafka")
    monkeypatch.delattr(owner, name)
    lost = aiokafka_internals.check(again=True)
    assert set(lost) == {capability.name} and name in lost[capability.name]
    aiokafka_internals.check()  # checked once: no second warning
    assert not aiokafka_internals.usable(capability)
    (warning,) = _warnings(caplog)
    message = warning.getMessage()
    assert f"aiokafka {aiokafka.__version__}" in message
    assert says in message and name in message


def test_a_renamed_instance_attribute_is_seen_from_the_constructor(
    room: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A future aiokafka that keeps its fetcher under another name: the constructor no
    # longer assigns the one the room uses.
    from aiokafka.consumer.fetcher import Fetcher

    def renamed(self: object, *args: object, **kwargs: object) -> None:
        self.fetch_min = 1  # type: ignore[attr-defined]

    monkeypatch.setattr(Fetcher, "__init__", renamed)
    assert set(aiokafka_internals.check(again=True)) == {aiokafka_internals.FETCH_WAIT.name}
    consumer = SimpleNamespace()
    assert aiokafka_internals.fetch_wait(consumer) is None
    assert not aiokafka_internals.set_fetch_wait(consumer, 1, 5)


def test_each_function_falls_back_without_its_capability(
    room: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        aiokafka_internals, "_lost", {c.name: "gone" for c in aiokafka_internals.CAPABILITIES}
    )
    client = SimpleNamespace(cluster=SimpleNamespace())
    assert not aiokafka_internals.prefer_brokers(client, lambda _c: 1)
    assert not hasattr(client, "get_random_node")  # aiokafka's random choice stays
    assert not aiokafka_internals.abandon_queued(SimpleNamespace(), RuntimeError())
    assert aiokafka_internals.fetch_wait(SimpleNamespace()) is None
    assert not aiokafka_internals.install_oauth_exchange()
    assert not aiokafka_internals.install_lenient_header_names()


def test_an_internal_that_fails_in_use_is_lost_and_said_once(
    room: None, caplog: pytest.LogCaptureFixture
) -> None:
    # Passed the start check, then is not where the room looks (a consumer not started,
    # or an aiokafka that moved it): a warning, a fallback, never an AttributeError.
    caplog.set_level(logging.WARNING, logger="outbox.kafka")
    for _ in range(3):
        assert aiokafka_internals.fetch_wait(SimpleNamespace()) is None
    assert not aiokafka_internals.usable(aiokafka_internals.FETCH_WAIT)
    (warning,) = _warnings(caplog)
    assert "fetch linger disabled" in warning.getMessage()
    assert aiokafka.__version__ in warning.getMessage()


async def test_a_rejected_token_gets_the_rfc_7628_reply_that_makes_the_broker_say_so(
    room: None,
) -> None:
    assert aiokafka_internals.install_oauth_exchange()
    assert aiokafka_internals.install_oauth_exchange()  # once: not a subclass of itself
    exchange_class = aiokafka.conn.OAuthAuthenticator
    assert not getattr(exchange_class.__bases__[0], "_outbox_rfc7628", False)

    def exchange() -> object:
        return exchange_class(sasl_oauth_token_provider=oauth_tokens.valid)

    rejected = exchange()
    first = await rejected.step(None)  # type: ignore[attr-defined]
    assert first is not None and first[0].startswith(b"n,,\x01auth=Bearer ")
    assert await rejected.step(b'{"status":"invalid_token"}') == (b"\x01", True)  # type: ignore[attr-defined]
    assert await rejected.step(b"") is None  # type: ignore[attr-defined]  # once only
    accepted = exchange()
    await accepted.step(None)  # type: ignore[attr-defined]
    assert await accepted.step(b"") is None  # type: ignore[attr-defined]  # success: empty
    odd = exchange()
    await odd.step(None)  # type: ignore[attr-defined]
    assert await odd.step(b"not json") is None  # type: ignore[attr-defined]


# ------------------------------------------------------------- undecodable header names


def _batch(base: int, records: list[tuple[bytes, list[tuple[str, bytes]]]], codec: int) -> bytes:
    # aiokafka's pure-Python builder: it sends a RawName's bytes (tests/support/raw_headers.py).
    builder = default_records._DefaultRecordBatchBuilderPy(
        magic=2,
        compression_type=codec,
        is_transactional=0,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        batch_size=1 << 20,
    )
    for delta, (value, headers) in enumerate(records):
        builder.append(delta, timestamp=1_000 + delta, key=b"k", value=value, headers=headers)
    data = bytearray(builder.build())
    data[:8] = base.to_bytes(8, "big")  # the broker sets the base offset
    return bytes(data)


@pytest.mark.parametrize("codec", [0, 1], ids=["plain", "gzip"])
def test_a_header_name_not_utf8_is_read_escaped_and_the_fetch_goes_on(
    room: None, monkeypatch: pytest.MonkeyPatch, codec: int
) -> None:
    # One fetch, read as aiokafka's fetcher reads it: two batches, the bad record inside
    # the first, good ones before and after it and in the next batch.
    bad = RawName(b"user-\xff\xfename")
    data = _batch(
        0,
        [(b"a", [("ok", b"1")]), (b"b", [("ce_id", b"x"), (bad, b"v\xff")]), (b"c", [])],
        codec,
    ) + _batch(3, [(b"d", [("ok", b"4")])], codec)
    tp = TopicPartition("t", 0)

    def read() -> list[object]:
        records = fetcher.MemoryRecords(data)
        return list(fetcher.PartitionRecords(tp, records, [], 0, None, None, True, 0))

    # aiokafka's own reader, whatever an earlier test of this process installed (the
    # lenient one is process-wide); put back after.
    monkeypatch.setattr(fetcher, "MemoryRecords", memory_records.MemoryRecords)
    with pytest.raises(UnicodeDecodeError):  # aiokafka alone: the fetch fails
        read()
    assert aiokafka_internals.install_lenient_header_names()
    got = read()
    assert [(r.offset, r.value) for r in got] == [(0, b"a"), (1, b"b"), (2, b"c"), (3, b"d")]
    assert got[1].headers == (("ce_id", b"x"), ("user-\\xff\\xfename", b"v\xff"))
    assert [type(h) for h in got[1].headers] == [tuple, UndecodedHeader]
    assert all(type(h) is tuple for r in got if r is not got[1] for h in r.headers)
    assert got[1].timestamp == 1_001 and got[1].key == b"k"


def test_a_reader_that_no_longer_reads_such_a_record_is_lost_at_start(
    room: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An aiokafka whose record type took other arguments: the start check reads a record
    # back and sees it, instead of a consumer failing on the first such record.
    monkeypatch.setattr(default_records, "_DefaultRecordPy", lambda *args: None)
    aiokafka_records._lenient_class.cache_clear()
    try:
        lost = aiokafka_internals.check(again=True)
    finally:
        aiokafka_records._lenient_class.cache_clear()
    assert set(lost) == {aiokafka_internals.HEADER_NAMES.name}
