"""Fixtures of the integration tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest

from outbox.settings import OutboxSettings
from relay import Relay
from tests.support.wal import wal_source


@pytest.fixture
async def running() -> AsyncIterator[Callable[[OutboxSettings], Awaitable[Relay]]]:
    """``await running(settings)`` starts a relay in this process; all stop at the end."""
    started: list[tuple[Relay, asyncio.Task[None]]] = []

    async def start(s: OutboxSettings) -> Relay:
        relay = Relay(s)
        started.append((relay, asyncio.create_task(relay.run())))
        return relay

    yield start
    for relay, _ in started:
        relay.stop()
    for _, task in started:
        await asyncio.wait_for(task, 15)


@pytest.fixture
def wal_settings(isolated_settings: OutboxSettings) -> Iterator[OutboxSettings]:
    """Isolated settings in WAL mode, with a slot and publication of their own."""
    with wal_source(isolated_settings) as own:
        yield own
