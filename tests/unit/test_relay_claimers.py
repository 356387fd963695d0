"""Which pipelines claim (relay/sources/table/claimers.py): one while claims are small, all under a
backlog."""

from __future__ import annotations

import asyncio

import pytest

from outbox.settings import RelaySettings
from relay.event import PAYLOAD
from relay.sources.table import claimers as crew_module
from relay.sources.table.claimers import Claimers

LANES = list(range(8))


def rows(n: int, size: int = 10) -> list[tuple[object, ...]]:
    row: list[object] = [None] * 13
    row[PAYLOAD] = b"x" * size
    return [tuple(row)] * n


def crew(**settings: object) -> Claimers:
    return Claimers(RelaySettings(**{"pipelines": 2, "batch_size": 100, **settings}))  # type: ignore[arg-type]


async def test_a_light_stream_is_claimed_by_the_first_pipeline_alone() -> None:
    c = crew()
    assert c.lanes(0, LANES) == LANES
    assert c.lanes(1, LANES) == []
    c.claimed(rows(24))  # under a quarter of batch_size
    assert not c.busy()
    assert c.lanes(1, LANES) == []


async def test_a_big_claim_gives_every_pipeline_its_own_slice() -> None:
    c = crew(pipelines=3)
    c.claimed(rows(25))
    assert c.busy()
    assert c.lanes(0, LANES) == [0, 3, 6]
    assert c.lanes(1, LANES) == [1, 4, 7]
    assert c.lanes(2, LANES) == [2, 5]


async def test_a_claim_big_in_bytes_counts_as_big() -> None:
    c = crew(max_inflight_bytes=8 * 1024 * 1024)  # 4 MiB per pipeline, big from 1 MiB
    c.claimed(rows(2, size=600 * 1024))
    assert c.busy()


async def test_busy_ends_a_while_after_the_last_big_claim(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(crew_module, "BUSY_HOLD_SECONDS", 0.05)
    c = crew()
    c.claimed(rows(50))
    assert c.busy()
    await asyncio.sleep(0.08)
    assert not c.busy()
    assert c.lanes(1, LANES) == []


async def test_a_waiting_pipeline_wakes_at_a_big_claim() -> None:
    c = crew()
    loop = asyncio.get_running_loop()
    started = loop.time()
    waiter = asyncio.create_task(c.wait_busy(5.0))
    await asyncio.sleep(0.01)
    c.claimed(rows(100))
    await asyncio.wait_for(waiter, 1.0)
    assert loop.time() - started < 1.0
    # A later wait while busy returns at once.
    await asyncio.wait_for(c.wait_busy(5.0), 0.1)


async def test_one_pipeline_always_claims_every_lane() -> None:
    c = crew(pipelines=1)
    assert c.lanes(0, LANES) == LANES
    c.claimed(rows(100))
    assert c.lanes(0, LANES) == LANES


async def test_a_slow_batch_gives_every_pipeline_its_own_slice() -> None:
    c = crew(min_poll_interval_seconds=0.005)
    c.settled(0.009)  # under two poll intervals: the first pipeline keeps up alone
    assert not c.busy()
    c.settled(0.011)
    assert c.busy()
    assert c.lanes(1, LANES) == [1, 3, 5, 7]
