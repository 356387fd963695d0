"""Shared fixtures. Each test session gets its own freshly migrated database, so parallel
test runs against the same PostgreSQL never see each other's rows."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import ExitStack

import psycopg
import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings
from sqlalchemy import Engine
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import migrate
from outbox.db import async_engine as make_async_engine
from outbox.db import sync_engine
from outbox.settings import OutboxSettings
from tests.support import kafka as kafka_support
from tests.support.pgbouncer import PgBouncer, PgBouncerFailed, pgbouncer
from tests.support.services import Endpoints, Secured, ServiceUnavailable, endpoints
from tests.support.tables import own_tables

# Property-based tests (tests/property): a fixed, reproducible sample in CI (derandomized,
# no example database); new examples each run locally; HYPOTHESIS_PROFILE=thorough for a
# long hunt. Fixtures shared by the examples (a connection, a slot, a running consumer) are
# the point there, hence the health checks left out.
_SHARED = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]
for _name, _examples in (("ci", 300), ("dev", 200), ("thorough", 3000)):
    hypothesis_settings.register_profile(
        _name,
        max_examples=_examples,
        deadline=None,
        suppress_health_check=_SHARED,
        **({"derandomize": True, "database": None} if _name == "ci" else {}),
    )
hypothesis_settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev")
)


@pytest.fixture(scope="session")
def services() -> Iterator[Endpoints]:
    try:
        with endpoints() as found, kafka_support.scratch_topics_deleted(found.kafka_bootstrap):
            yield found
    except ServiceUnavailable as exc:
        pytest.fail(f"test services unavailable: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def secured(services: Endpoints) -> Secured:
    """Kafka SASL_SSL, PostgreSQL TLS and the test CA of scripts/services (never skipped)."""
    try:
        return services.require_secured()
    except ServiceUnavailable as exc:
        pytest.fail(f"secured test services unavailable: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def pgbouncers(services: Endpoints) -> Iterator[Callable[[str, int], PgBouncer]]:
    """``pgbouncers("transaction", 3)``: a PgBouncer in that pool mode with that many server
    connections, in front of the test PostgreSQL (any database name), started once per
    session. A missing pgbouncer binary fails the test."""
    started: dict[tuple[str, int], PgBouncer] = {}
    with ExitStack() as stack:

        def get(mode: str, pool_size: int) -> PgBouncer:
            if (mode, pool_size) not in started:
                try:
                    bouncer = pgbouncer(services.database_url, mode, pool_size)
                    started[mode, pool_size] = stack.enter_context(bouncer)
                except PgBouncerFailed as exc:
                    pytest.fail(str(exc), pytrace=False)
            return started[mode, pool_size]

        yield get


def _admin_dsn(url: str, dbname: str) -> str:
    return (
        make_url(url)
        .set(drivername="postgresql", database=dbname)
        .render_as_string(hide_password=False)
    )


@pytest.fixture(scope="session")
def database_url(services: Endpoints) -> Iterator[str]:
    """A fresh database for this test session, dropped at the end."""
    name = f"outbox_test_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    try:
        admin = psycopg.connect(_admin_dsn(services.database_url, "postgres"), autocommit=True)
    except psycopg.OperationalError as exc:
        pytest.fail(
            f"PostgreSQL ({services.how}) not reachable: {type(exc).__name__}; "
            "start it with `scripts/services up`",
            pytrace=False,
        )
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    yield make_url(services.database_url).set(database=name).render_as_string(hide_password=False)
    with psycopg.connect(_admin_dsn(services.database_url, "postgres"), autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def base_settings(database_url: str, services: Endpoints) -> OutboxSettings:
    s = OutboxSettings(database_url=database_url, kafka_bootstrap_servers=services.kafka_bootstrap)  # type: ignore[arg-type]
    migrate.upgrade(s)
    return s


@pytest.fixture(scope="session")
def settings(base_settings: OutboxSettings) -> OutboxSettings:
    """Settings of the session database (default schema and prefix, migrated).

    Modules whose tests run relays override this with ``isolated_settings``: a relay
    publishes every pending row of its tables, so it must not see other tests' rows.
    """
    return base_settings


@pytest.fixture
def isolated_settings(base_settings: OutboxSettings) -> OutboxSettings:
    """Settings with tables of their own (a fresh table prefix, migrated) for one test."""
    return own_tables(base_settings)


@pytest.fixture(scope="session")
def engine(base_settings: OutboxSettings) -> Iterator[Engine]:
    e = sync_engine(base_settings, pool_size=10)
    yield e
    e.dispose()


@pytest.fixture
async def aengine(base_settings: OutboxSettings) -> AsyncIterator[AsyncEngine]:
    e = make_async_engine(base_settings)
    yield e
    await e.dispose()


@pytest.fixture
def kafka_bootstrap(services: Endpoints) -> str:
    return services.kafka_bootstrap


@pytest.fixture
def new_topic(kafka_bootstrap: str) -> Callable[..., Awaitable[str]]:
    """``await new_topic(partitions=3)`` creates a uniquely named topic."""

    async def make(partitions: int = 1, name: str | None = None) -> str:
        return await kafka_support.create_topic(kafka_bootstrap, name, partitions)

    return make
