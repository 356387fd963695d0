"""Helpers for relay tests: publish numbered events, run relays as subprocesses, and check
what a dedupe-by-event_id consumer would see (lost, duplicates, out-of-order per key)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from aiokafka import AIOKafkaConsumer
from sqlalchemy import Engine, text

from outbox import Outbox
from outbox.envelope import Message, lane_for
from outbox.settings import OutboxSettings
from outbox.tables import build_tables
from tests.support.kafka import Record, read_until

ROOT = Path(__file__).resolve().parents[2]


def fast(settings: OutboxSettings, **relay: object) -> OutboxSettings:
    """Settings for an in-process relay under test: quick heartbeats and retries."""
    r = settings.relay.model_copy(update={"heartbeat_seconds": 0.3, **relay})
    retry = settings.retry.model_copy(update={"base_seconds": 0.05, "cap_seconds": 1.0})
    return settings.model_copy(update={"relay": r, "retry": retry})


def publish_numbered(
    engine: Engine,
    settings: OutboxSettings,
    topic: str,
    count: int,
    *,
    keys: int = 50,
    per_tx: int = 100,
    start: int = 0,
    event_type: str = "test.numbered",
) -> list[str]:
    """Commit ``count`` events; payload {"key", "seq"} with seq increasing per key."""
    ob = Outbox(settings)
    ids: list[str] = []
    for base in range(start, start + count, per_tx):
        msgs = [
            Message(
                topic=topic,
                key=f"k{n % keys}",
                event_type=event_type,
                payload={"key": f"k{n % keys}", "seq": n},
            )
            for n in range(base, min(base + per_tx, start + count))
        ]
        with engine.begin() as conn:
            ids.extend(str(i) for i in ob.publish_many(conn, msgs))
    return ids


def pending(engine: Engine, settings: OutboxSettings) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    f'SELECT count(*) FROM "{settings.db_schema}"."{settings.table_prefix}events"'
                    " WHERE published_at IS NULL"
                )
            ).scalar_one()
        )


def wait_drained(engine: Engine, settings: OutboxSettings, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    left = pending(engine, settings)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = pending(engine, settings)
    return left


@dataclass(frozen=True)
class Verdict:
    received: int
    unique: int
    lost: int
    duplicates: int
    out_of_order: int
    unexpected: int


def verdict(records: Iterable[Record], expected_ids: Sequence[str]) -> Verdict:
    """Drop duplicates by ce_id (first seen wins), then count per-key order violations:
    adjacent pairs of one key whose seq goes down."""
    seen: set[str] = set()
    last_seq: dict[str, int] = {}
    received = duplicates = out_of_order = 0
    for rec in records:
        received += 1
        ce_id = rec.headers["ce_id"].decode()
        if ce_id in seen:
            duplicates += 1
            continue
        seen.add(ce_id)
        body = json.loads(rec.value)
        key, seq = body["key"], body["seq"]
        if key in last_seq and seq < last_seq[key]:
            out_of_order += 1
        last_seq[key] = max(seq, last_seq.get(key, seq))
    expected = set(expected_ids)
    return Verdict(
        received=received,
        unique=len(seen),
        lost=len(expected - seen),
        duplicates=duplicates,
        out_of_order=out_of_order,
        unexpected=len(seen - expected),
    )


def relay_env(settings: OutboxSettings, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(
        OUTBOX_DATABASE_URL=settings.database_url.get_secret_value(),
        OUTBOX_KAFKA_BOOTSTRAP_SERVERS=settings.kafka_bootstrap_servers,
        OUTBOX_DB_SCHEMA=settings.db_schema,
        OUTBOX_TABLE_PREFIX=settings.table_prefix,
        OUTBOX_RELAY__HEARTBEAT_SECONDS="0.5",
        OUTBOX_RETRY__BASE_SECONDS="0.05",
        OUTBOX_RETRY__CAP_SECONDS="2",
    )
    env.update(extra)
    return env


def outbox_cli(
    *args: str, env: dict[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_outbox_exe(), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
    )


def _outbox_exe() -> str:
    exe = Path(sys.executable).with_name("outbox")
    return str(exe) if exe.exists() else "outbox"


class RelayProcess:
    """``outbox relay`` as a subprocess, stderr captured to a file for post-mortems."""

    def __init__(self, env: dict[str, str], log_dir: Path, name: str, *args: str) -> None:
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [_outbox_exe(), "relay", *args],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()

    def terminate(self, timeout: float = 15) -> tuple[int, float]:
        """SIGTERM; returns (exit code, seconds it took to exit)."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        finally:
            self.kill()
        return code, time.monotonic() - t0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


async def read_ids(
    bootstrap: str, topic: str, expected_ids: Sequence[str], wait_seconds: float = 60.0
) -> list[Record]:
    """Read ``topic`` from the start until every expected ce_id was seen (duplicates
    included in the result) or time ran out."""
    want = set(expected_ids)

    def all_seen(record: Record) -> bool:
        want.discard(record.headers.get("ce_id", b"").decode())
        return not want

    if not want:
        return []
    return await read_until(bootstrap, topic, all_seen, wait_seconds)


def commit_large(
    engine: Engine, settings: OutboxSettings, topic: str, rows: int, size: int, keys: int = 20
) -> list[str]:
    """Commit ``rows`` events of about ``size`` bytes in one transaction (built by the
    database: cheap to insert), JSON {"key", "seq", "pad"} with seq increasing per key."""
    names = [f"k{i}" for i in range(keys)]
    lanes = [lane_for(k.encode(), uuid.uuid4(), settings.lanes) for k in names]
    events = build_tables(settings).events
    with engine.begin() as conn:
        result = conn.execute(
            text(
                f"INSERT INTO {events.fullname} (event_id, topic, key, lane, event_type,"
                " source, content_type, payload, fingerprint)"
                " SELECT gen_random_uuid(), :topic, convert_to(n.name, 'UTF8'), n.lane,"
                " 'test.large', 'urn:test', 'application/json',"
                " convert_to(json_build_object('key', n.name, 'seq', n.g,"
                "  'pad', repeat(md5(n.g::text), :chunks))::text, 'UTF8'), '\\x00'::bytea"
                " FROM (SELECT g, (CAST(:names AS text[]))[1 + g % :k] AS name,"
                "  (CAST(:lanes AS int2[]))[1 + g % :k] AS lane"
                "  FROM generate_series(0, :rows - 1) g) n ORDER BY n.g"
                " RETURNING event_id::text"
            ),
            {
                "topic": topic,
                "names": names,
                "lanes": lanes,
                "k": keys,
                "chunks": size // 32,
                "rows": rows,
            },
        )
        return [r[0] for r in result]


async def read_slim(
    bootstrap: str, topic: str, expected_ids: Sequence[str], wait_seconds: float = 120.0
) -> list[Record]:
    """Like :func:`read_ids` for large records: each value is cut to its key and seq (the
    rest is dropped as it is read), so a test can read hundreds of megabytes."""
    want = set(expected_ids)
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id=None
    )
    await consumer.start()
    records: list[Record] = []
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_seconds
        while want and loop.time() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            for msgs in batch.values():
                for m in msgs:
                    found = _KEY_SEQ.match(m.value or b"")
                    assert found is not None, (m.value or b"")[:80]
                    value = json.dumps({"key": found[1].decode(), "seq": int(found[2])})
                    headers = dict(m.headers)
                    records.append(
                        Record(m.topic, m.partition, m.offset, m.key, value.encode(), headers)
                    )
                    want.discard(headers.get("ce_id", b"").decode())
    finally:
        await consumer.stop()
    return records


_KEY_SEQ = re.compile(rb'\{"key"\s*:\s*"([^"]*)",\s*"seq"\s*:\s*(\d+)')


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM of /proc/PID/status), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for pid {pid}")
