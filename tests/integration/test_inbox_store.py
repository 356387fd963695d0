"""The inbox store's attempt-marker statements against a real PostgreSQL."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from inbox.store import InboxStore, Marker
from outbox.settings import OutboxSettings
from outbox.tables import build_tables

pytestmark = pytest.mark.integration


async def test_disarming_on_release_leaves_a_new_owners_marker_alone(
    settings: OutboxSettings, aengine: AsyncEngine
) -> None:
    store = InboxStore(build_tables(settings))
    consumer, topic = f"c-{uuid.uuid4().hex[:8]}", "orders"
    auto = aengine.execution_options(isolation_level="AUTOCOMMIT")
    async with auto.connect() as conn:
        # The old owner armed (10, 41) ahead; the new owner took over and is retrying
        # offset 10 alone after a crash: its marker counts two attempts.
        await store.set_marker(conn, consumer, topic, 0, Marker(10, 10, 2, "ProcessCrashed"))
        await store.disarm_marker(conn, consumer, topic, 0, (10, 41))  # the old owner, late
        assert await store.marker(conn, consumer, topic, 0) == Marker(10, 10, 2, "ProcessCrashed")

        # Its own marker, still as it armed it: disarmed.
        await store.set_marker(conn, consumer, topic, 1, Marker(10, 41, 1, None))
        await store.disarm_marker(conn, consumer, topic, 1, (10, 41))
        assert await store.marker(conn, consumer, topic, 1) == Marker(10, 41, 0, None)
