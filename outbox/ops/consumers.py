"""Who consumes, and what they did: a consumer group's members as Kafka describes them
(for the console and ``outbox lag``), and the group's figures per minute that its members
add to the ``consumer_stats`` table (inbox/stats.py).

Kafka names each member (its member id, client id and the host it connects from, as the
broker sees it) and the partitions the group's leader assigned it; it does not say since
when a member is there. A group with no member has no running consumer, whatever its lag.
"""

from __future__ import annotations

import datetime as dt
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.db import translated_errors
from outbox.ops.store import OpsStore
from outbox.settings import OutboxSettings
from outbox.tables import build_tables


@dataclass(frozen=True)
class GroupMember:
    member_id: str
    client_id: str
    host: str  # as the broker sees the connection (an address, usually)
    partitions: tuple[tuple[str, int], ...]  # (topic, partition), sorted


@dataclass(frozen=True)
class GroupState:
    state: str  # Kafka's: Stable, Empty, PreparingRebalance, CompletingRebalance, Dead
    members: tuple[GroupMember, ...]

    @classmethod
    def of(cls, described: Mapping[str, Any]) -> GroupState:
        members = tuple(
            GroupMember(
                member_id=m["member_id"],
                client_id=m["client_id"],
                host=m["client_host"].lstrip("/"),
                partitions=assignment(m["member_assignment"]),
            )
            for m in described["members"]
        )
        return cls(described["state"], tuple(sorted(members, key=lambda m: m.partitions)))


def assignment(raw: bytes) -> tuple[tuple[str, int], ...]:
    """The partitions a ``consumer``-protocol member assignment names (Kafka's
    ConsumerProtocolAssignment: version int16, then [topic string, [partition int32]],
    then user data; an empty or unreadable one names none)."""
    found: list[tuple[str, int]] = []
    try:
        at = 2
        (topics,) = struct.unpack_from(">i", raw, at)
        at += 4
        for _ in range(max(0, topics)):
            (size,) = struct.unpack_from(">h", raw, at)
            at += 2
            topic = raw[at : at + size].decode("utf-8", "replace")
            at += size
            (count,) = struct.unpack_from(">i", raw, at)
            at += 4
            for partition in struct.unpack_from(f">{max(0, count)}i", raw, at):
                found.append((topic, partition))
            at += 4 * max(0, count)
    except struct.error:
        pass
    return tuple(sorted(found))


@dataclass(frozen=True)
class Minute:
    at: dt.datetime  # the minute's start (database clock)
    seconds: float  # how much of it is covered: 60, or less for the current minute
    processed: int
    handler_seconds: float
    dead_lettered: int
    retries: int

    @property
    def per_second(self) -> float:
        return self.processed / self.seconds

    @property
    def ms_per_event(self) -> float | None:
        """Handler time per processed event (None: nothing was processed)."""
        return 1000 * self.handler_seconds / self.processed if self.processed else None


@dataclass
class Activity:
    """A group's minutes over a window (oldest first) and the database's time then."""

    now: dt.datetime
    minutes: dict[str, list[Minute]] = field(default_factory=dict)


async def activity(engine: AsyncEngine, settings: OutboxSettings, seconds: int = 3600) -> Activity:
    """Every group's per-minute figures of the last ``seconds`` (consumer_stats)."""
    store = OpsStore(build_tables(settings))
    with translated_errors():
        async with engine.connect() as conn:
            rows = (await conn.execute(store.consumer_minutes, {"seconds": seconds})).all()
            if not rows:
                now = (await conn.execute(store.db_now())).scalar_one()
                return Activity(now)
    found = Activity(rows[0].now)
    for row in rows:
        covered = min(60.0, max(1.0, (row.now - row.minute).total_seconds()))
        found.minutes.setdefault(row.consumer, []).append(
            Minute(
                row.minute,
                covered,
                int(row.processed),
                float(row.handler_seconds),
                int(row.dead_lettered),
                int(row.retries),
            )
        )
    return found
