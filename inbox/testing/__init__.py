"""Testing a consumer app's handlers through the real processing path, without Kafka.

::

    async def test_order_created_reserves_stock(inbox_harness):
        first = await inbox_harness.deliver("order.created", OrderCreated(...), key="o1")
        assert first.outcome == "handled"
        again = await inbox_harness.deliver(first.event)
        assert again.outcome == "duplicate"

    async def test_projection_takes_lists(inbox_harness):
        events = [inbox_harness.event("order.created", OrderCreated(...)) for _ in range(3)]
        result = await inbox_harness.deliver_batch(events)
        assert (result.handled, result.calls) == (3, 1)

The pytest plugin (installed with the package) provides the fixtures; a project's
``conftest.py`` names its app in one line: ``inbox_app = app_fixture(app)``.
"""

from inbox.testing.harness import (
    BatchDelivery,
    DeadLetterRecord,
    Delivery,
    InboxHarness,
    Outcome,
    Record,
)
from inbox.testing.plugin import app_fixture

__all__ = [
    "BatchDelivery",
    "DeadLetterRecord",
    "Delivery",
    "InboxHarness",
    "Outcome",
    "Record",
    "app_fixture",
]
