"""Operator actions on dead letters: list, show, replay, purge (``outbox dlq``).

A replay goes through the normal path: the inbox row is flipped to ``replaying`` (one
commit) and the original record is produced again to its source topic. The consumer's
inbox claim lets exactly one copy of that event through, so the handler runs once more
even if the replay itself is repeated or the record is delivered twice. An event that
was processed since (an earlier replay) is refused.
"""

from __future__ import annotations

import builtins
import contextlib
import datetime as dt
from dataclasses import dataclass, field

from aiokafka.errors import KafkaError
from sqlalchemy.ext.asyncio import AsyncEngine

from inbox.envelopes.base import EVENT_ID_HEADER
from inbox.errors import DeadLetterNotFound
from inbox.kafka import KafkaSink, dlq_producer
from inbox.store import InboxStore
from outbox.db import async_engine, translated_errors
from outbox.errors import AmbiguousId, BrokerUnavailable, ConfigurationError
from outbox.kafka.clients import start_kafka
from outbox.ops.deadletters import DeadLetter, DeadLetterFilter, DeadLetterGroup
from outbox.settings import OutboxSettings
from outbox.tables import build_tables

REPLAY_HEADER = "dlq_replay"
_REPLAY_HEADERS = (REPLAY_HEADER, EVENT_ID_HEADER)


@dataclass
class ReplayReport:
    replayed: list[DeadLetter] = field(default_factory=list)
    refused: list[DeadLetter] = field(default_factory=list)


def _of(consumer: str | None) -> str:
    return "" if consumer is None else f" for consumer {consumer!r}"


class DeadLetters:
    def __init__(self, settings: OutboxSettings, engine: AsyncEngine | None = None) -> None:
        self._settings = settings
        self._engine = engine or async_engine(settings)
        self._own_engine = engine is None
        self._store = InboxStore(build_tables(settings))

    async def close(self) -> None:
        if self._own_engine:
            await self._engine.dispose()

    async def list(
        self,
        where: DeadLetterFilter,
        limit: int | None = 100,
        offset: int = 0,
        newest_first: bool = False,
    ) -> list[DeadLetter]:
        with translated_errors():
            async with self._engine.connect() as conn:
                return await self._store.dead_letters(conn, where, limit, offset, newest_first)

    async def count(self, where: DeadLetterFilter) -> int:
        with translated_errors():
            async with self._engine.connect() as conn:
                return await self._store.count_dead_letters(conn, where)

    async def count_by_state(self, where: DeadLetterFilter) -> dict[str, int]:
        """How many of the matching dead letters are dead, replaying, processed and
        forgotten (outbox/ops/deadletters.py STATES)."""
        with translated_errors():
            async with self._engine.connect() as conn:
                return await self._store.count_by_state(conn, where)

    async def groups(
        self, where: DeadLetterFilter, limit: int = 100
    ) -> builtins.list[DeadLetterGroup]:
        """The matching dead letters grouped by error (class + normalised message)."""
        with translated_errors():
            async with self._engine.connect() as conn:
                return await self._store.dead_letter_groups(conn, where, limit)

    async def by_day(self, days: int = 14) -> builtins.list[tuple[dt.date, int]]:
        with translated_errors():
            async with self._engine.connect() as conn:
                return await self._store.dead_letters_by_day(conn, days)

    async def get(self, consumer: str | None, event_id: str) -> DeadLetter:
        """One dead letter; without ``consumer``, the event id must be dead for one
        consumer only (else :class:`AmbiguousId`, naming them)."""
        found = await self.list(DeadLetterFilter(consumer=consumer, event_id=event_id), 6)
        if not found:
            raise DeadLetterNotFound(f"no dead letter with id {event_id!r}{_of(consumer)}")
        if len(found) > 1:
            names = ", ".join(sorted(x.consumer for x in found[:5]))
            names += ", …" if len(found) > 5 else ""
            raise AmbiguousId(
                f"event {event_id!r} is a dead letter of several consumers ({names}): "
                "give one with -c/--consumer"
            )
        return found[0]

    async def resolve(self, event_id: str, consumer: str | None = None) -> str:
        """The full event id ``event_id`` names: itself, or the one dead letter's id it is
        a prefix of (``0a4f`` for ``0a4f9c…``, as git takes commit ids). Raises
        :class:`DeadLetterNotFound`, or :class:`AmbiguousId` with how many ids it fits."""
        with translated_errors():
            async with self._engine.connect() as conn:
                ids, total = await self._store.dead_letter_ids(conn, event_id, consumer, 3)
        if ids and (ids[0] == event_id or total == 1):
            return ids[0]
        if not ids:
            raise DeadLetterNotFound(f"no dead letter with id {event_id!r}{_of(consumer)}")
        raise AmbiguousId(
            f"{total} dead letters{_of(consumer)} have an event id starting {event_id!r} "
            f"({', '.join(ids)}{', …' if total > len(ids) else ''}): give more of it"
        )

    async def replay(self, where: DeadLetterFilter) -> ReplayReport:
        report = ReplayReport()
        letters = await self.list(where, limit=None)
        if not letters:
            return report
        producer = dlq_producer(self._settings)
        try:
            await start_kafka(producer, self._settings)
        except (KafkaError, ConfigurationError) as exc:
            with contextlib.suppress(Exception):
                await producer.stop()
            if isinstance(exc, ConfigurationError):
                raise
            at = self._settings.kafka_bootstrap_servers
            raise BrokerUnavailable(f"Kafka unreachable at {at}: {type(exc).__name__}") from exc
        sink = KafkaSink(producer)
        try:
            for letter in letters:
                with translated_errors():
                    async with self._engine.begin() as conn:
                        allowed = await self._store.mark_replaying(conn, letter)
                if not allowed:
                    report.refused.append(letter)
                    continue
                # Marked first, produced second: a crash in between leaves the row
                # `replaying` and a rerun of the replay produces it then.
                # The record as it was, plus the replay count and the id the inbox knows
                # the event by (kept when that id was the record's position: see
                # inbox/envelopes/base.py position_id).
                headers = [
                    *((n, v) for n, v in letter.headers if n not in _REPLAY_HEADERS),
                    (REPLAY_HEADER, str(letter.replays + 1).encode()),
                    (EVENT_ID_HEADER, letter.event_id.encode()),
                ]
                await sink.send(letter.topic, letter.key, letter.value, headers)
                report.replayed.append(letter)
        finally:
            await producer.stop()
        return report

    async def purge(self, where: DeadLetterFilter) -> int:
        with translated_errors():
            async with self._engine.begin() as conn:
                return await self._store.purge_dead_letters(conn, where)
