"""Static group membership (KIP-345): a consumer that returns under the same
``group_instance_id`` within its session timeout triggers no rebalance.

aiokafka (0.14) sends no LeaveGroup on ``stop()`` when an instance id is set, so a clean
SIGTERM keeps the member's partitions parked, unread, until the same id joins again (or
the session times out and Kafka rebalances). What this module adds:

* the consumer options: the instance id (``{hostname}`` resolved), the static session
  timeout, and the rebalance timeout kept at the dynamic session's 10 s (aiokafka defaults
  it to the session timeout: a rebalance would then wait up to 45 s for a member that
  is gone);
* the brokers' bounds for the session timeout, read at start with the admin client, so
  that a refusal is one line naming the setting instead of a failed join;
* telling a duplicate id. Measured on Kafka 4.1 with aiokafka 0.14: when a second live
  process joins with an id already in use, Kafka gives it the member (same generation, no
  rebalance); aiokafka's heartbeat and offset commit requests are too old to carry the
  instance id, so the first process hears UNKNOWN_MEMBER_ID, silently joins again and takes
  the member back — and so on, both consuming every partition of that member in turn. Only
  a JoinGroup or SyncGroup in flight at the moment of a take-over is answered
  FENCED_INSTANCE_ID (code 82), which aiokafka does not know: it raises
  ``KafkaError('UnknownError()')`` from ``getmany``. :func:`register_fenced_error` names
  code 82, and :class:`Membership` sees a take-over as a join at the generation this
  process already had. Of the two, the process that had been a member for less than
  :func:`newcomer_seconds` when first taken over stops (exit 2); the other takes the member
  back — when it was fenced, by joining afresh (aiokafka would retry under the fenced
  member id, and be fenced again forever).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Mapping
from typing import Any

from aiokafka import errors as kerr
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import BrokerResponseError, KafkaError

from inbox.errors import DuplicateInstanceId, SessionTimeoutRefused
from outbox.kafka import aiokafka_internals
from outbox.kafka.client import Consumer
from outbox.kafka.clients import kafka_admin, start_kafka
from outbox.kafka.errors import raise_admin_failure
from outbox.settings import OutboxSettings

log = logging.getLogger("outbox.inbox")

FENCED_INSTANCE_ID = 82
# The rebalance timeout a static member keeps: aiokafka's default session (see above).
REBALANCE_TIMEOUT_MS = 10_000
# Which of two processes with one id stops: the one that had been a member for less than
# this when it first found itself taken over. The newcomer is taken over at the other's
# next heartbeat (3 s) or offset commit, and sees it at its own next one: within two
# heartbeats. Two processes started closer together than this may both stop.
NEWCOMER_SECONDS = 10.0
HEARTBEAT_MS = 3000  # aiokafka's default heartbeat_interval_ms


def newcomer_seconds(heartbeat_ms: int) -> float:
    """NEWCOMER_SECONDS, or three heartbeats when the app's heartbeats are slower."""
    return max(NEWCOMER_SECONDS, 3 * heartbeat_ms / 1000)


_MIN, _MAX = "group.min.session.timeout.ms", "group.max.session.timeout.ms"


class FencedInstanceIdError(BrokerResponseError):  # type: ignore[misc]  # aiokafka is untyped
    errno = FENCED_INSTANCE_ID
    message = "FENCED_INSTANCE_ID"
    description = "Another member with the same group instance id took this one's place."


def register_fenced_error() -> None:
    """Name Kafka's error code 82, which aiokafka 0.14 maps to UnknownError: its errors
    then keep the broker's error name (``KafkaError('FencedInstanceIdError()')``). Through
    the Kafka room, which says once when this aiokafka does not allow it."""
    aiokafka_internals.name_error_code(FENCED_INSTANCE_ID, FencedInstanceIdError)


def is_fenced(exc: BaseException) -> bool:
    """aiokafka wraps the join's error as ``KafkaError(repr(error))``: the name is all
    that is left of it (a :class:`~outbox.errors.GroupError`'s ``name`` or message)."""
    name = FencedInstanceIdError.__name__
    return (
        isinstance(exc, FencedInstanceIdError)
        or getattr(exc, "name", None) == name
        or (name in str(exc))
    )


def static_options(settings: OutboxSettings, app_options: Mapping[str, Any]) -> dict[str, Any]:
    """The consumer options of static membership (empty without an instance id); the
    app's own ``kafka_options`` win."""
    config = settings.consumer
    instance_id = config.instance_id(socket.gethostname())
    if instance_id is None:
        return {}
    options = {
        "group_instance_id": instance_id,
        "session_timeout_ms": config.static_session_timeout_ms,
        "rebalance_timeout_ms": REBALANCE_TIMEOUT_MS,
    }
    return {name: v for name, v in options.items() if name not in app_options}


async def check_session_timeout(settings: OutboxSettings, timeout_ms: int) -> None:
    """Refuse (exit 2) a session timeout outside the brokers' group bounds. A broker that
    does not let this client describe its configuration is logged and passed: the join
    then says INVALID_SESSION_TIMEOUT if it must."""
    admin = kafka_admin(settings)
    try:
        await start_kafka(admin, settings)
        brokers = (await admin.describe_cluster())["brokers"]
        wanted = {_MIN: None, _MAX: None}
        resources = [
            ConfigResource(ConfigResourceType.BROKER, str(b["node_id"]), wanted) for b in brokers
        ]
        values: dict[str, list[int]] = {_MIN: [], _MAX: []}
        for response in await admin.describe_configs(resources):
            for code, _message, _type, _name, entries, *_ in response.resources:
                if code:
                    log.warning(
                        "cannot read the brokers' group session bounds (%s); not checked",
                        type(kerr.for_code(code)()).__name__,
                    )
                    return
                for entry in entries:
                    if entry[0] in values and entry[1] is not None:
                        values[entry[0]].append(int(entry[1]))
    except KafkaError as exc:
        raise_admin_failure(exc)
    finally:
        await admin.close()
    low, high = max(values[_MIN], default=0), min(values[_MAX], default=timeout_ms)
    if not low <= timeout_ms <= high:
        raise SessionTimeoutRefused(
            f"OUTBOX_CONSUMER__STATIC_SESSION_TIMEOUT_MS is {timeout_ms}, the brokers take "
            f"{low}..{high} ({_MIN} .. {_MAX}); set it within, or raise the brokers' bound"
        )


def session_refused(
    exc: BaseException, timeout_ms: int, static: bool
) -> SessionTimeoutRefused | None:
    """The join's INVALID_SESSION_TIMEOUT as a configuration error naming what sets it."""
    invalid = kerr.InvalidSessionTimeoutError
    if not isinstance(exc, invalid) and getattr(exc, "name", None) != invalid.__name__:
        return None
    setting = (
        "OUTBOX_CONSUMER__STATIC_SESSION_TIMEOUT_MS"
        if static
        else "session_timeout_ms (the app's kafka_options or OUTBOX_KAFKA__OPTIONS)"
    )
    return SessionTimeoutRefused(
        f"Kafka refuses the group session timeout {timeout_ms} ms (InvalidSessionTimeoutError); "
        f"set {setting} within the brokers' {_MIN} .. {_MAX}"
    )


class Membership:
    """Tells a take-over of this process's instance id by another live process.

    Kafka gives a static member a new generation only through a rebalance. A join at the
    generation this process already had is therefore the other process's take-over being
    taken back (see the module docstring)."""

    def __init__(
        self,
        kafka: Consumer,
        group: str,
        instance_id: str,
        heartbeat_ms: int = HEARTBEAT_MS,
    ) -> None:
        self._kafka = kafka
        self._newcomer = newcomer_seconds(heartbeat_ms)
        self.group = group
        self.instance_id = instance_id
        self._generation: int | None = None
        self._first_join: float | None = None
        self._incumbent: bool | None = None  # decided at the first take-over

    def joined(self) -> DuplicateInstanceId | None:
        """Called when partitions are assigned; the error to stop with, when this process
        is the newcomer of a duplicate pair. (Never, when the Kafka room cannot read the
        group's generation: it said so at start.)"""
        generation = self._kafka.group_generation()
        if generation is None:
            return None
        now = time.monotonic()
        previous, self._generation = self._generation, generation
        if self._first_join is None:
            self._first_join = now
            return None
        if previous != generation:
            return None  # a rebalance
        if not self._is_incumbent():
            return self.duplicate("it had the member first and took it back")
        log.error(
            "another live consumer joined with group instance id %s and took this member "
            "over; took it back (that process stops if it started last)",
            self.instance_id,
            extra={"group": self.group, "instance_id": self.instance_id},
        )
        return None

    def survives(self, exc: BaseException) -> bool:
        """``exc`` came from ``getmany``: True when it is the fencing of the process that
        had the member first — its join or sync was in flight when the newcomer took the
        member. aiokafka would join again under the fenced member id, and be fenced
        forever; with the member id reset it joins afresh and takes the member back (the
        newcomer then stops)."""
        if not is_fenced(exc) or not self._is_incumbent():
            return False
        if not self._kafka.reset_member():
            return False
        log.error(
            "another live consumer joined with group instance id %s and fenced this member "
            "(FencedInstanceIdError); joining again (that process stops if it started last)",
            self.instance_id,
            extra={"group": self.group, "instance_id": self.instance_id},
        )
        return True

    def _is_incumbent(self) -> bool:
        """Decided at the first take-over: had this process been a member for long?"""
        if self._incumbent is None:
            first = self._first_join
            self._incumbent = first is not None and time.monotonic() - first > self._newcomer
        return self._incumbent

    def duplicate(self, cause: str) -> DuplicateInstanceId:
        return DuplicateInstanceId(self.instance_id, self.group, cause)
