"""The consumer's start-up checks, before it joins its group: a member that cannot process
would take partitions from healthy ones. A configuration error (a refused login, tables
missing or behind, a topic missing, a session timeout the brokers refuse) raises at once
(exit 2); while the database or Kafka is merely unreachable (still starting), each check
waits with backoff, one log line per outage (the daemon's ``Dependency``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from inbox.app import Consumer
from inbox.failures import infrastructure_cause
from inbox.kafka import ensure_topics
from inbox.membership import check_session_timeout, static_options
from outbox.errors import BrokerUnavailable, DatabaseUnavailable
from outbox.migrate import check_schema
from outbox.outages import Dependency
from outbox.poolers import probe_session
from outbox.resilience.retry import RetryPolicy
from outbox.settings import OutboxSettings

log = logging.getLogger("outbox.inbox")


@dataclass(frozen=True)
class DatabaseReady:
    """What the database check found."""

    settings: OutboxSettings  # to run with: db_pooler "transaction" when the probe met one
    server: str | None  # host:port (primary|standby) the probe reached


async def database_ready(
    settings: OutboxSettings, database: Dependency, policy: RetryPolicy, stop: asyncio.Event
) -> DatabaseReady | None:
    """Connect once: a refusal (credentials, unknown database, TLS) or tables missing
    or behind this version (:func:`outbox.migrate.check_schema`) raise at once;
    while the database is merely unreachable (still starting), wait with backoff.
    None when stopped meanwhile.

    The connection is a session probe (``outbox/poolers.py``): behind a transaction
    pooler the consumer runs without server-side prepared statements, whatever
    ``db_pooler`` says. Nothing else it does needs a session: every statement runs in
    a transaction that starts and ends on one server session."""
    while True:  # at least one try, even when asked to stop already
        try:
            probe = await probe_session(settings)
            # The tables at this version's revision, or SchemaMissing (exit 2) before
            # the group sees this member: it would take partitions, then die on them.
            await asyncio.to_thread(check_schema, settings)
        except DatabaseUnavailable as error:
            database.failed(error)
        else:
            database.ok()
            if probe.mode == "transaction" and settings.db_pooler != "transaction":
                # The consumer copes; producers' engines on this URL would not.
                log.warning(
                    "database behind a transaction pooler: running without server-side "
                    "prepared statements; set OUTBOX_DB_POOLER=transaction wherever this "
                    "URL is used",
                    extra={"session": probe.describe()},
                )
                settings = settings.model_copy(update={"db_pooler": "transaction"})
            return DatabaseReady(settings, probe.address)
        if not await _retry_wait(policy, database, stop):
            return None


async def topics_ready(
    settings: OutboxSettings,
    clients: OutboxSettings,
    app: Consumer,
    kafka: Dependency,
    policy: RetryPolicy,
    stop: asyncio.Event,
) -> bool:
    """Check the topics (and create the dead-letter ones): a refusal or a missing topic
    raises at once; while Kafka is merely unreachable, wait with backoff. False when
    stopped meanwhile. ``clients``: the settings with the app's own Kafka client options."""
    while True:
        try:
            await ensure_topics(clients, app.topics)
            static = static_options(settings, app.kafka_options)
            if "session_timeout_ms" in static:
                await check_session_timeout(clients, static["session_timeout_ms"])
            kafka.ok()
            return True
        except BrokerUnavailable as exc:
            kafka.failed(infrastructure_cause(exc))
        if not await _retry_wait(policy, kafka, stop):
            return False


async def _retry_wait(policy: RetryPolicy, down: Dependency, stop: asyncio.Event) -> bool:
    """Back off before the next try at start-up; False when asked to stop."""
    if stop.is_set():
        return False
    delay = policy.backoff(min(down.failures, 10))
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), delay)
    return not stop.is_set()
