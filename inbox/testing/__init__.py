"""Testing a consumer app's handlers through the real processing path, without Kafka.

::

    async def test_order_created_reserves_stock(inbox_harness):
        first = await inbox_harness.deliver("order.created", OrderCreated(...), key="o1")
        assert first.outcome == "handled"
        again = await inbox_harness.deliver(first.event)
        assert again.outcome == "duplicate"

The pytest plugin (installed with the package) provides the fixtures; a project's
``conftest.py`` names its app in one line: ``inbox_app = app_fixture(app)``.
"""

from inbox.testing.harness import DeadLetterRecord, Delivery, InboxHarness, Outcome, Record
from inbox.testing.plugin import app_fixture

__all__ = ["DeadLetterRecord", "Delivery", "InboxHarness", "Outcome", "Record", "app_fixture"]
