"""The how-to "Project events into a table": its handler module, run as printed through
the harness (the daemon's processing path) on real PostgreSQL."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
from sqlalchemy import Engine, text

from inbox.testing import InboxHarness
from outbox.settings import OutboxSettings
from tests.support.snippets import snippets

pytestmark = pytest.mark.integration
PAGE = "docs/howto/project-into-table.md"


def _module(tmp_path: Path) -> ModuleType:
    path = tmp_path / "projection.py"
    path.write_text(snippets(PAGE)["projection.py"])
    spec = importlib.util.spec_from_file_location("projection", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_the_projection_upserts_the_latest_total_and_dead_letters_a_bad_one(
    settings: OutboxSettings, engine: Engine, tmp_path: Path
) -> None:
    projection = _module(tmp_path)
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE IF EXISTS order_totals"))
        conn.execute(
            text(
                "CREATE TABLE order_totals (order_id text PRIMARY KEY, customer_id text NOT "
                "NULL, total_cents bigint NOT NULL, event_id text NOT NULL)"
            )
        )
    placed = projection.OrderPlaced
    try:
        async with InboxHarness(projection.app, settings) as harness:
            events = [
                harness.event("order.placed", placed(order_id=o, customer_id="c", total_cents=t))
                for o, t in (("o1", 100), ("o2", 200), ("o1", 150), ("o3", -5), ("o4", 400))
            ]
            first = await harness.deliver_batch(events)
            again = await harness.deliver_batch(events[:2])
        with engine.connect() as conn:
            rows = dict(conn.execute(text("SELECT order_id, total_cents FROM order_totals")).all())
    finally:
        with engine.begin() as conn:
            conn.execute(text("DROP TABLE order_totals"))
    # o1 updated twice in one list: the later event wins; o3 alone is dead-lettered.
    assert rows == {"o1": 150, "o2": 200, "o4": 400}
    assert [d.event_id for d in first.dead_letters] == [events[3].event_id]
    assert (first.handled, again.counts["duplicates"], again.calls) == (4, 2, 0)
