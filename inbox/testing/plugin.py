"""The pytest plugin of outbox-inbox (entry point ``pytest11``): fixtures for users' tests.

* ``outbox_settings`` (session): the project's settings (``OUTBOX_*`` environment, as in
  production) with tables of their own — a fresh table prefix, migrated at the start and
  dropped at the end — so tests never touch the real outbox and inbox tables. Override it
  to choose differently.
* ``outbox_engine`` (session): a sync engine on that database, for creating the
  project's own tables and running units of work.
* ``outbox_published``: ``outbox_published(session, topic=None)``, what a unit of work
  published (see :mod:`outbox.testing`).
* ``inbox_app``: the consumer app under test; name it in ``conftest.py`` with
  ``inbox_app = app_fixture(app)`` (or the ini option ``inbox_app = module:attribute``).
* ``inbox_harness``: an :class:`~inbox.testing.harness.InboxHarness` for ``inbox_app``;
  after each test the inbox forgets that consumer (processed events, dead letters, sequences).

Nothing here needs an async plugin: the harness is created synchronously and opens its
connections inside the test's own event loop.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine

from inbox.app import Consumer
from inbox.store import InboxStore
from inbox.testing.harness import InboxHarness
from outbox import migrate
from outbox.db import sync_engine
from outbox.imports import import_target
from outbox.settings import OutboxSettings, load_settings
from outbox.tables import build_tables
from outbox.testing import PublishedEvent, published


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("inbox_app", "the consumer app under test, as module:attribute")


def app_fixture(app: Consumer) -> Any:
    """A fixture named ``inbox_app`` returning ``app``: ``inbox_app = app_fixture(app)``."""

    @pytest.fixture(name="inbox_app")
    def inbox_app() -> Consumer:
        return app

    return inbox_app


@pytest.fixture(scope="session")
def outbox_settings() -> Iterator[OutboxSettings]:
    settings = load_settings(table_prefix=f"test_{uuid.uuid4().hex[:8]}_")
    migrate.upgrade(settings)
    yield settings
    migrate.downgrade(settings, "base")


@pytest.fixture(scope="session")
def outbox_engine(outbox_settings: OutboxSettings) -> Iterator[Engine]:
    engine = sync_engine(outbox_settings)
    yield engine
    engine.dispose()


@pytest.fixture
def outbox_published(
    outbox_settings: OutboxSettings,
) -> Callable[..., list[PublishedEvent]]:
    def read(session: Any, topic: str | None = None) -> list[PublishedEvent]:
        return published(session, outbox_settings, topic)

    return read


@pytest.fixture
def inbox_app(request: pytest.FixtureRequest) -> Consumer:
    target = request.config.getini("inbox_app")
    if not target:
        raise pytest.UsageError(
            "no consumer app to test: add `inbox_app = app_fixture(app)` to conftest.py "
            "or set the ini option inbox_app = module:attribute"
        )
    try:
        app = import_target(str(target))
    except ValueError as exc:
        raise pytest.UsageError(f"inbox_app {target}: {exc}") from None
    if not isinstance(app, Consumer):
        raise pytest.UsageError(f"inbox_app {target} is not an inbox.Consumer")
    return app


@pytest.fixture
def inbox_harness(
    inbox_app: Consumer, outbox_settings: OutboxSettings, outbox_engine: Engine
) -> Iterator[InboxHarness]:
    """A harness for ``inbox_app``; afterwards the inbox forgets the app's events, markers,
    dead letters and sequences, so each test starts as if the consumer were new."""
    yield InboxHarness(inbox_app, outbox_settings)
    with outbox_engine.begin() as conn:
        for statement in InboxStore(build_tables(outbox_settings)).forget_consumer(inbox_app.name):
            conn.execute(statement)
