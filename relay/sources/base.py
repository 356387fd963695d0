"""What a source is to the relay: :class:`Source`, and what the daemon shares with it.

A source reads events and hands them to the publisher, in order per key, and settles what
Kafka answered (relay/verdict.py) before it lets go of an event: the table source deletes or
marks a row only in the transaction that saw it acknowledged, the WAL source confirms the
slot only past events acknowledged or moved to the failed table. Everything else a relay
has — its identity and row in the relays table, its heartbeat, the publisher and Kafka's
state, the metrics and the status line, the maintenance services — is the daemon's
(relay/daemon.py), whatever the source.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from outbox.outages import Dependency
from outbox.resilience.retry import RetryPolicy
from relay.database import Database
from relay.kafka.publisher import Publisher
from relay.kafka.state import KafkaState
from relay.kafka.wording import Wording
from relay.metrics import RelayMetrics
from relay.outage import OutageGuard
from relay.registration import Identity
from relay.verdict import Verdicts


@dataclass(frozen=True)
class Shared:
    """What the daemon gives its source: one of each per relay."""

    database: Database
    # The database's up/down state, shared by every loop (one log line per outage).
    database_state: Dependency
    db_retry: RetryPolicy
    publisher: Publisher
    kafka: KafkaState
    metrics: RelayMetrics
    verdicts: Verdicts
    identity: Identity  # who this relay is: its connections say so to the database

    def guard(self, *, counted: bool = True) -> OutageGuard:
        """A loop's outage guard (``counted``: its outages count in the errors metric)."""
        count = self.metrics.errors.labels
        return OutageGuard(
            self.database_state,
            self.db_retry,
            (lambda exc: count(type(exc).__name__).inc()) if counted else None,
        )


class Source(Protocol):
    """One way of reading events (``OUTBOX_SOURCE``). The registry of what operator tools
    may assume of each is outbox/sources.py; a new source is added to both."""

    name: str  # as OUTBOX_SOURCE and the relays table name it
    wording: Wording  # how the Kafka side's log lines name its events

    def tasks(self, stopping: asyncio.Event) -> dict[str, Coroutine[Any, Any, None]]:
        """Its own tasks by name, run until ``stopping`` (the daemon watches them with its
        own: one that fails stops the relay)."""
        ...

    @property
    def connected(self) -> bool:
        """Its database connections are up (part of ``/healthz``)."""
        ...

    def owned_lanes(self) -> list[int]:
        """The ordering lanes it owns now, for the relays table (none: a source without
        lanes)."""
        ...

    def status(self, database_up: bool) -> dict[str, int | float | str]:
        """Its figures for the relay's status line: counts as integers, what the database
        gives ``unknown`` while it is down (:meth:`RelayMetrics.measured`)."""
        ...

    def retention_horizon(self) -> int | None:
        """An outbox id at or below which every writer has finished (the claim horizon), if
        the source knows one: the outbox retention may resume its walk below it."""
        ...

    async def close(self) -> None:
        """Release what it holds (locks, connections), after its tasks ended."""
        ...
