"""The shop's own tests, written the way a user of outbox-inbox tests their code: the
package's pytest plugin provides the fixtures; this file names the app under test and
creates the shop's tables in the test database."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine

from examples.shop import consumer, service
from inbox.testing import app_fixture

inbox_app = app_fixture(consumer.app)


@pytest.fixture(scope="session", autouse=True)
def shop_tables(outbox_engine: Engine) -> None:
    service.metadata.create_all(outbox_engine)
    consumer.metadata.create_all(outbox_engine)
