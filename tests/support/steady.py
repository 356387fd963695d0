"""A steady stream for the database-fault and failover tests: a producer thread that
publishes through the outbox (10 events per transaction every 50 ms, over 40 keys), and
the consumer app that stores each event as an effect row.

A failed transaction is retried as it was, with the same event ids: a COMMIT that failed
(a lost connection, a failover) may have committed, and the inbox absorbs the copy.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import Message, Outbox
from outbox.db import sync_engine
from outbox.settings import OutboxSettings

KEYS = 40


@dataclass
class SteadyProducer:
    """Publishes ``{"key", "seq"[, "pad"]}`` events in a thread until stopped; seq rises per
    key. ``pad`` makes each payload's ``pad`` field."""

    settings: OutboxSettings
    topic: str
    pad: Callable[[], str] | None = None
    published: int = 0
    errors: list[BaseException] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:  # one thread at a time: chunks follow `published`
            return
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def finish(self) -> int:
        self.stop.set()
        assert self._thread is not None
        self._thread.join(60)
        return self.published

    def _chunk(self, start: int) -> list[Message]:
        return [
            Message(
                topic=self.topic,
                key=f"key-{n % KEYS}",
                event_type="test.event",
                event_id=uuid.uuid5(uuid.NAMESPACE_URL, f"{self.topic}/{n}"),
                payload={"key": f"key-{n % KEYS}", "seq": n // KEYS}
                | ({"pad": self.pad()} if self.pad else {}),
            )
            for n in range(start, start + 10)
        ]

    def _run(self) -> None:
        engine = sync_engine(self.settings, pool_size=1)
        outbox = Outbox(self.settings)
        try:
            chunk = self._chunk(0)
            while not self.stop.is_set():
                try:
                    with Session(engine) as session, session.begin():
                        outbox.publish_many(session, chunk)
                except Exception as exc:
                    self.errors.append(exc)
                    self.stop.wait(0.2)
                    continue
                self.published += len(chunk)
                chunk = self._chunk(self.published)
                self.stop.wait(0.05)
        finally:
            engine.dispose()


@dataclass(frozen=True)
class Effects:
    """A topic, a consumer group of that name, its effects table and its app module."""

    topic: str
    group: str
    table: str
    module: str

    def cli_env(self, tmp_path: Path, root: Path) -> tuple[tuple[str, str], ...]:
        """The daemons' environment: the app importable, INFO logs, quick retries."""
        return (
            ("PYTHONPATH", f"{tmp_path}:{root}"),
            ("OUTBOX_LOG_LEVEL", "INFO"),
            ("OUTBOX_RETRY__BASE_SECONDS", "0.05"),
            ("OUTBOX_RETRY__CAP_SECONDS", "1"),
        )


def effects(engine: Engine, tmp_path: Path, name: str, pad: bool) -> Effects:
    """A fresh topic name, effects table (``applied_at``: when the handler's transaction
    ran) and consumer app writing it, named after ``name``."""
    suffix = uuid.uuid4().hex[:8]
    topic = f"{name}-{suffix}"
    table = f"effects_{suffix}"
    with engine.begin() as conn:
        conn.execute(
            text(
                f"CREATE TABLE {table} (id bigserial PRIMARY KEY, event_id text NOT NULL, "
                "key text, seq int, payload text, "
                "applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
            )
        )
    module = effects_app(tmp_path, f"{name}_app", topic, topic, table, pad)
    return Effects(topic, topic, table, module)


def effects_app(tmp_path: Path, name: str, group: str, topic: str, effects: str, pad: bool) -> str:
    """Write the module of a consumer app that inserts each event into ``effects``
    (event_id, key, seq[, payload]); its import name."""
    module = f"{name}_{group.replace('-', '_')}"
    columns, values, params = "event_id, key, seq", ":e, :k, :s", "'e': event.event_id, "
    params += "'k': body['key'], 's': body['seq']"
    if pad:
        columns, values, params = (
            columns + ", payload",
            values + ", :p",
            params + ", 'p': body['pad']",
        )
    (tmp_path / f"{module}.py").write_text(
        "import json\n"
        "from sqlalchemy import text\n"
        "import inbox\n"
        f"app = inbox.Consumer(name={group!r}, topics=[{topic!r}])\n"
        "@app.handler('test.event')\n"
        "async def store(event: inbox.InboxEvent, session: object) -> None:\n"
        "    body = json.loads(event.value)\n"
        "    await session.execute(\n"
        f"        text('INSERT INTO {effects} ({columns}) VALUES ({values})'),\n"
        f"        {{{params}}},\n"
        "    )\n"
    )
    return module
