"""The Kafka room: every use of aiokafka beyond its documented API, and nowhere else.

The relay and the consumer need a few things aiokafka does not offer publicly: choosing
which broker answers a metadata or producer-id question (a hung broker otherwise holds a
start or a group coordinator lookup for a whole request timeout), one metadata request to
a chosen broker (the leader watch, the consumer's metadata watch), failing the batches a
dead broker holds when a producer is retired, changing a running consumer's fetch wait
(fetch linger), finishing the OAUTHBEARER exchange as RFC 7628 says, and reading a record
whose header name is not UTF-8 (aiokafka fails the whole fetch on it). Each is named
here as a :class:`Capability` and reached through one function; callers never touch the
private names themselves (``tests/unit/test_aiokafka_internals.py`` greps for them).

Each capability is checked once, at the daemon's start (:func:`check`): when this aiokafka
lacks or changed an internal, one WARNING names the aiokafka version and what is lost,
and the functions fall back to aiokafka's public behaviour. A function that still trips
over a change the check could not see (an internal that exists but behaves otherwise)
marks its capability lost, says so once the same way, and falls back: never a silent
no-op, never a crash. ``tests/integration/test_kafka_canary.py`` exercises every internal
against the installed aiokafka and a real broker.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiokafka

log = logging.getLogger("outbox.kafka")


@dataclass(frozen=True)
class Capability:
    name: str
    lost: str  # what an operator loses without it, for the WARNING
    uses: str  # the internals it rests on


BROKER_CHOICE = Capability(
    "broker choice",
    "hung-broker failover disabled (aiokafka asks a broker chosen at random, a hung one "
    "included, for producer ids, metadata and group coordinators)",
    "AIOKafkaClient.get_random_node, AIOKafkaConsumer._client, AIOKafkaAdminClient._client",
)
METADATA = Capability(
    "metadata requests",
    "leader watch disabled (a partition stalled on a hung broker waits for the request "
    "timeout) and the consumer's metadata watch falls back to a plain topic listing",
    "aiokafka.protocol.metadata.MetadataRequest, AIOKafkaClient.send, "
    "ClusterMetadata.update_metadata, AIOKafkaConsumer._client, AIOKafkaAdminClient._client",
)
ABANDON = Capability(
    "abandon queued batches",
    "a retired producer waits up to the ack timeout for batches queued on a dead broker, "
    "and a stopping one leaves them queued until the relay exits (their rows stay in the "
    "outbox)",
    "AIOKafkaProducer._message_accumulator (_batches, _pending_batches, fail_all), "
    "MessageBatch (future, _drain_waiter)",
)
FETCH_WAIT = Capability(
    "fetch wait",
    "fetch linger disabled (fetches keep the application's own settings)",
    "AIOKafkaConsumer._fetcher (_fetch_min_bytes, _fetch_max_wait_ms)",
)
OAUTH_EXCHANGE = Capability(
    "OAUTHBEARER exchange",
    "a rejected OAUTHBEARER token looks like a broker that never answers instead of "
    "SaslAuthenticationFailed",
    "aiokafka.conn.OAuthAuthenticator",
)
GROUP_GENERATION = Capability(
    "group generation",
    "a second live consumer with the same group instance id is not told apart (the two take "
    "the member from each other in turn; the inbox still applies each event once)",
    "AIOKafkaConsumer._coordinator (generation, reset_generation), aiokafka.errors.kafka_errors",
)
HEADER_NAMES = Capability(
    "undecodable header names",
    "a record whose header name is not UTF-8 stops the consumer (aiokafka fails every fetch "
    "of its partition with UnicodeDecodeError) instead of being dead-lettered",
    "aiokafka.consumer.fetcher.MemoryRecords, aiokafka.record.default_records "
    "(_DefaultRecordBatchPy: _read_msg, _buffer, _pos; _DefaultRecordPy)",
)
CAPABILITIES = (
    BROKER_CHOICE,
    METADATA,
    ABANDON,
    FETCH_WAIT,
    OAUTH_EXCHANGE,
    GROUP_GENERATION,
    HEADER_NAMES,
)

# Capability name -> why it is lost; None until checked. Process-wide, like aiokafka.
_lost: dict[str, str] | None = None
_warned: set[str] = set()


def _module(name: str) -> Any:
    return importlib.import_module(name)


def _assigns(cls: type, *attributes: str) -> str | None:
    """None when ``cls.__init__`` sets every one of ``attributes``, else what is missing.
    (Instance attributes exist only on instances; the constructor's code names them.)"""
    code = getattr(getattr(cls, "__init__", None), "__code__", None)
    names = set(code.co_names) if code is not None else set()
    missing = [a for a in attributes if a not in names]
    return f"{cls.__name__} no longer sets {', '.join(missing)}" if missing else None


def _method(cls: type, name: str) -> str | None:
    return None if callable(getattr(cls, name, None)) else f"{cls.__name__}.{name} is gone"


def _request_class() -> Any:
    """``MetadataRequest`` in its current form: a class taking the topics (0.13 and
    later), or the list of versioned structs of 0.12 and before (version 1: a list of
    topics, the brokers in the answer)."""
    kind = getattr(_module("aiokafka.protocol.metadata"), "MetadataRequest", None)
    if isinstance(kind, list | tuple) and len(kind) > 1:
        return kind[1]
    if isinstance(kind, type):
        return kind
    raise LookupError("aiokafka.protocol.metadata.MetadataRequest is gone")


def _probe_broker_choice() -> str | None:
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.client import AIOKafkaClient

    return (
        _method(AIOKafkaClient, "get_random_node")
        or _assigns(aiokafka.AIOKafkaConsumer, "_client")
        or _assigns(AIOKafkaAdminClient, "_client")
    )


def _probe_metadata() -> str | None:
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.client import AIOKafkaClient
    from aiokafka.cluster import ClusterMetadata

    try:
        _request_class()
    except LookupError as exc:
        return str(exc)
    return (
        _method(AIOKafkaClient, "send")
        or _method(ClusterMetadata, "update_metadata")
        or _assigns(aiokafka.AIOKafkaConsumer, "_client")
        or _assigns(AIOKafkaAdminClient, "_client")
    )


def _probe_abandon() -> str | None:
    from aiokafka.producer.message_accumulator import MessageAccumulator, MessageBatch

    return (
        _assigns(aiokafka.AIOKafkaProducer, "_message_accumulator")
        or _assigns(MessageAccumulator, "_batches", "_pending_batches")
        or _method(MessageAccumulator, "fail_all")
        or _assigns(MessageBatch, "future", "_drain_waiter")
    )


def _probe_fetch_wait() -> str | None:
    from aiokafka.consumer.fetcher import Fetcher

    return _assigns(aiokafka.AIOKafkaConsumer, "_fetcher") or _assigns(
        Fetcher, "_fetch_min_bytes", "_fetch_max_wait_ms"
    )


def _probe_oauth() -> str | None:
    found = getattr(_module("aiokafka.conn"), "OAuthAuthenticator", None)
    if not isinstance(found, type):
        return "aiokafka.conn.OAuthAuthenticator is gone"
    return _method(found, "step")


def _probe_group_generation() -> str | None:
    from aiokafka.consumer.group_coordinator import GroupCoordinator

    errors = _module("aiokafka.errors")
    if not isinstance(getattr(errors, "kafka_errors", None), dict):
        return "aiokafka.errors.kafka_errors is gone"
    return (
        _assigns(aiokafka.AIOKafkaConsumer, "_coordinator")
        or _assigns(GroupCoordinator, "generation")
        or _method(GroupCoordinator, "reset_generation")
    )


def _probe_header_names() -> str | None:
    fetcher = _module("aiokafka.consumer.fetcher")
    if not isinstance(getattr(fetcher, "MemoryRecords", None), type):
        return "aiokafka.consumer.fetcher.MemoryRecords is gone"
    records = _module("aiokafka.record.default_records")
    for name in ("_DefaultRecordBatchPy", "_DefaultRecordPy"):
        if not isinstance(getattr(records, name, None), type):
            return f"aiokafka.record.default_records.{name} is gone"
    from outbox.kafka.aiokafka_records import read_back

    return _method(records._DefaultRecordBatchPy, "_read_msg") or read_back()


_PROBES: dict[str, Callable[[], str | None]] = {
    BROKER_CHOICE.name: _probe_broker_choice,
    METADATA.name: _probe_metadata,
    ABANDON.name: _probe_abandon,
    FETCH_WAIT.name: _probe_fetch_wait,
    OAUTH_EXCHANGE.name: _probe_oauth,
    GROUP_GENERATION.name: _probe_group_generation,
    HEADER_NAMES.name: _probe_header_names,
}


def check(*, again: bool = False) -> dict[str, str]:
    """Check every capability against the installed aiokafka (once per process unless
    ``again``); one WARNING lists those lost. Returns them (name -> why)."""
    global _lost
    if _lost is not None and not again:
        return dict(_lost)
    lost: dict[str, str] = {}
    for capability in CAPABILITIES:
        try:
            reason = _PROBES[capability.name]()
        except Exception as exc:  # an import moved, say: lost, never a crash
            reason = f"{type(exc).__name__}: {exc}"
        if reason is not None:
            lost[capability.name] = reason
    _lost = lost
    _warned.clear()
    if lost:
        _warned.update(lost)
        log.warning(
            "aiokafka %s: %s; falling back to aiokafka's public behaviour",
            aiokafka.__version__,
            "; ".join(
                f"{c.lost} [{c.name}: {lost[c.name]}]" for c in CAPABILITIES if c.name in lost
            ),
            extra={"aiokafka": aiokafka.__version__, "capabilities_lost": sorted(lost)},
        )
    return dict(lost)


def usable(capability: Capability) -> bool:
    """Whether ``capability`` works with this aiokafka (checking on first use)."""
    return capability.name not in check()


def _lose(capability: Capability, exc: BaseException) -> None:
    """An internal the start check passed failed in use: lost from now on, said once."""
    check()  # the start check's verdict first, then this loss on top
    assert _lost is not None
    _lost[capability.name] = f"{type(exc).__name__}: {exc}"
    if capability.name not in _warned:
        _warned.add(capability.name)
        log.warning(
            "aiokafka %s: %s [%s failed in use: %s: %s]; falling back to aiokafka's public "
            "behaviour",
            aiokafka.__version__,
            capability.lost,
            capability.name,
            type(exc).__name__,
            exc,
            extra={"aiokafka": aiokafka.__version__, "capabilities_lost": [capability.name]},
        )


# ------------------------------------------------------------------------- broker choice


def client_of(owner: Any) -> Any:
    """The ``AIOKafkaClient`` of a producer (public ``client``), consumer or admin client
    (or ``owner`` itself when it is one)."""
    if hasattr(owner, "cluster"):
        return owner
    client = getattr(owner, "client", None)
    if client is None or not hasattr(client, "cluster"):
        client = owner._client
    return client


def prefer_brokers(owner: Any, pick: Callable[[Any], int | None]) -> bool:
    """Route the broker ``owner``'s client picks "at random" (producer ids, metadata,
    coordinator lookups) through ``pick(client)``. False (aiokafka's random choice stays)
    when this aiokafka has no such choice."""
    if not usable(BROKER_CHOICE):
        return False
    try:
        client = client_of(owner)
        client.get_random_node = lambda: pick(client)
    except AttributeError as exc:
        _lose(BROKER_CHOICE, exc)
        return False
    return True


# ---------------------------------------------------------------------- metadata requests


def metadata_request(topics: Sequence[str]) -> Any:
    """A metadata request for ``topics`` (and the brokers Kafka lists)."""
    return _request_class()(list(topics))


async def ask_metadata(owner: Any, node: int | None, topics: Sequence[str]) -> Any:
    """One metadata request for ``topics`` to broker ``node`` through ``owner``'s client;
    the answer's ``to_object()`` has ``brokers`` and ``topics``. Raises what the request
    raises (a broker that does not answer). The caller checks :func:`usable` first."""
    try:
        client = client_of(owner)
        request = metadata_request(topics)
        send = client.send
    except (AttributeError, LookupError, TypeError) as exc:
        _lose(METADATA, exc)
        raise MetadataUnavailable(str(exc)) from exc
    return await send(node, request)


def update_cluster(owner: Any, answer: Any) -> None:
    """Give ``owner``'s client the view of the cluster a metadata ``answer`` holds."""
    try:
        client_of(owner).cluster.update_metadata(answer)
    except (AttributeError, TypeError) as exc:
        _lose(METADATA, exc)


class MetadataUnavailable(Exception):
    """This aiokafka cannot send the room's metadata request (said once at WARNING)."""


# ------------------------------------------------------------------ abandon queued batches


def abandon_queued(producer: Any, error: BaseException) -> bool:
    """Fail every batch ``producer`` still holds, queued or in flight, with ``error``
    (aiokafka has no public way; its accumulator's ``fail_all`` is what a dying sender
    uses), so that its ``stop()`` no longer waits for them. The accumulator keeps an
    "in flight" mark per batch, removed by a callback when the batch's future is done, and
    aiokafka removes it itself when a request in flight fails and the batch is queued
    again; each expects to find it (else a KeyError — the first one in the event loop, the
    second kills the producer's sender, and aiokafka's handler for that raises
    AttributeError: tracebacks at every stop during a broker hang). So a retried batch,
    queued without its mark, gets it back before failing, and the batches in flight get
    theirs back once the callbacks have run. False when this aiokafka cannot (the caller
    waits for its stop instead)."""
    if not usable(ABANDON):
        return False
    try:
        queue = producer._message_accumulator
        queued = {b for batches in queue._batches.values() for b in batches}
        in_flight = set(queue._pending_batches) - queued
        queue._pending_batches.update(b for b in queued if b.retry_count)
        for batch in queued | in_flight:
            # fail_all sets ``error`` on two futures per batch that may have no reader: the
            # batch's own (send_batch hands out a shield of it, and a caller cancelled while
            # it waited — a relay stopping — took the shield's reader away) and the waiter
            # for its drain (read only by a sender queueing behind it). Unread, asyncio
            # prints "Future exception was never retrieved ... ProducerClosed" at exit.
            batch.future.add_done_callback(_read_failure)
            batch._drain_waiter.add_done_callback(_read_failure)
        queue.fail_all(error)
    except AttributeError as exc:
        _lose(ABANDON, exc)
        return False
    if in_flight:
        # Callbacks run in the order they were scheduled: the marks' removal first.
        asyncio.get_running_loop().call_soon(queue._pending_batches.update, in_flight)
    return True


def _read_failure(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


# ------------------------------------------------------------------------------ fetch wait


def fetch_wait(consumer: Any) -> tuple[int, int] | None:
    """A started consumer's ``(fetch_min_bytes, fetch_max_wait_ms)``; None when this
    aiokafka keeps them where the room cannot change them."""
    if not usable(FETCH_WAIT):
        return None
    try:
        fetcher = consumer._fetcher
        return int(fetcher._fetch_min_bytes), int(fetcher._fetch_max_wait_ms)
    except (AttributeError, TypeError) as exc:
        _lose(FETCH_WAIT, exc)
        return None


def set_fetch_wait(consumer: Any, min_bytes: int, max_wait_ms: int) -> bool:
    """Change a started consumer's fetch settings; its fetcher reads them for every
    request. False when this aiokafka cannot."""
    if not usable(FETCH_WAIT):
        return False
    try:
        fetcher = consumer._fetcher
        fetcher._fetch_min_bytes, fetcher._fetch_max_wait_ms = min_bytes, max_wait_ms
    except AttributeError as exc:
        _lose(FETCH_WAIT, exc)
        return False
    return True


# ---------------------------------------------------------------------- group generation


def name_error_code(code: int, error: type) -> bool:
    """Give Kafka error ``code``, which this aiokafka does not know (``UnknownError``), the
    class ``error``, so its failures keep the broker's error name. False when it cannot."""
    if not usable(GROUP_GENERATION):
        return False
    errors = _module("aiokafka.errors")
    if errors.for_code(code) is errors.UnknownError:
        errors.kafka_errors[code] = error
    return errors.for_code(code) is error or errors.for_code(code) is not errors.UnknownError


def group_generation(consumer: Any) -> int | None:
    """The generation of the group a started consumer is a member of; None when this
    aiokafka does not let the room read it."""
    if not usable(GROUP_GENERATION):
        return None
    try:
        return int(consumer._coordinator.generation)
    except (AttributeError, TypeError, ValueError) as exc:
        _lose(GROUP_GENERATION, exc)
        return None


def reset_group_member(consumer: Any) -> bool:
    """Forget the consumer's member id, so that its next join is a fresh one (aiokafka
    would otherwise join again under a fenced id, and be fenced forever)."""
    if not usable(GROUP_GENERATION):
        return False
    try:
        consumer._coordinator.reset_generation()
    except AttributeError as exc:
        _lose(GROUP_GENERATION, exc)
        return False
    return True


# --------------------------------------------------------------- undecodable header names
#
# The lenient record reader is outbox/kafka/aiokafka_records.py: part of this room, a module
# of its own for its size.


def install_lenient_header_names() -> bool:
    """Make every consumer's fetches read a header name that is not UTF-8 instead of
    failing on it (process-wide, like aiokafka's fetcher). False when this aiokafka cannot
    (such a record stops the consumer: :class:`~outbox.errors.RecordUnreadable`)."""
    if not usable(HEADER_NAMES):
        return False
    from outbox.kafka.aiokafka_records import LenientRecords

    class Installed(LenientRecords):
        __slots__ = ()

        @staticmethod
        def lost(exc: BaseException) -> None:
            _lose(HEADER_NAMES, exc)

    fetcher = _module("aiokafka.consumer.fetcher")
    fetcher.MemoryRecords = Installed
    return True


# ------------------------------------------------------------ shielded requests, given up


# aiokafka's requests that run in tasks of their own, shielded from their caller's
# cancellation (a consumer's offset commit), by coroutine name. A future aiokafka that
# renames one makes its late failure a loud report again, never a silent one.
_SHIELDED_REQUESTS = frozenset({"GroupCoordinator._do_commit_offsets"})


def is_shielded_request(task: asyncio.Task[Any]) -> bool:
    """Whether ``task`` is one of aiokafka's shielded requests: a caller that gave up
    waiting for it (a daemon at stop) leaves its error unread."""
    return getattr(task.get_coro(), "__qualname__", None) in _SHIELDED_REQUESTS


# -------------------------------------------------------------------- OAUTHBEARER exchange


def install_oauth_exchange() -> bool:
    """Make every connection's OAUTHBEARER exchange finish as RFC 7628 (3.2.3) says (see
    :func:`_exchange_class`). False when this aiokafka has no exchange class to extend."""
    if not usable(OAUTH_EXCHANGE):
        return False
    conn = _module("aiokafka.conn")
    if getattr(conn.OAuthAuthenticator, "_outbox_rfc7628", False):
        return True
    conn.OAuthAuthenticator = _exchange_class(conn.OAuthAuthenticator)
    return True


def _exchange_class(base: type) -> type:
    class OAuthExchange(base):  # type: ignore[valid-type,misc]
        """aiokafka's OAUTHBEARER exchange, finished as RFC 7628 (3.2.3) says. A broker
        that rejects the token answers with an error challenge ({"status":
        "invalid_token"}) and fails the authentication only after the client replies
        %x01. aiokafka (0.14) stops after sending the token, so a rejected token looked
        like a success followed by a broker that never answered: clients retried metadata
        forever instead of failing with SaslAuthenticationFailed. Only the constructor
        and ``step`` are relied on."""

        _outbox_rfc7628 = True

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._sent = self._answered = False

        async def step(self, payload: bytes | None) -> tuple[bytes, bool] | None:
            if not self._sent:
                self._sent = True
                first: tuple[bytes, bool] | None = await super().step(payload)
                return first
            if payload and not self._answered and _error_challenge(payload):
                self._answered = True
                return b"\x01", True  # the broker now fails the exchange, with its reason
            return None

    return OAuthExchange


def _error_challenge(payload: bytes) -> bool:
    import json

    try:
        parsed = json.loads(payload)
    except ValueError:
        return False
    return isinstance(parsed, dict) and "status" in parsed
