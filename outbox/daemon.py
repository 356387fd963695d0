"""Plumbing shared by the relay and consumer daemons and the operator tools.

* Kafka clients built from settings — every producer, consumer and admin client of the
  project is made here, so connection settings are applied in one place;
* the HTTP endpoint serving ``/metrics`` and ``/healthz`` on a background thread;
* SIGTERM/SIGINT mapped to a graceful stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import random
import signal
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NoReturn, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka import errors as kerr
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.conn import create_conn
from aiokafka.errors import (
    AuthenticationFailedError,
    KafkaConnectionError,
    KafkaError,
    SaslAuthenticationFailed,
    UnsupportedSaslMechanismError,
)
from aiokafka.helpers import create_ssl_context
from prometheus_client import CollectorRegistry, make_wsgi_app
from pydantic import SecretStr

from outbox import kafka_room
from outbox.errors import BrokerRefused, BrokerUnavailable, ConfigurationError
from outbox.oauthbearer import TokenUnavailable, token_provider
from outbox.settings import KafkaSettings, OutboxSettings

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PROBE_SECONDS = 10.0  # the one diagnostic connection after a failed start


# ---------------------------------------------------------------------------- Kafka clients


def kafka_options(settings: OutboxSettings) -> dict[str, Any]:
    """Connection options every Kafka client of the project shares: brokers, TLS, SASL."""
    k = settings.kafka
    options: dict[str, Any] = {
        "bootstrap_servers": settings.kafka_bootstrap_servers,
        "security_protocol": k.security_protocol,
    }
    if k.uses_tls:
        options["ssl_context"] = _ssl_context(k)
    if k.uses_sasl:
        options["sasl_mechanism"] = k.sasl_mechanism
        if k.sasl_oauth_token_provider is not None:
            options["sasl_oauth_token_provider"] = token_provider(k.sasl_oauth_token_provider)
        else:
            assert k.sasl_password is not None  # KafkaSettings refuses SASL without one
            options["sasl_plain_username"] = k.sasl_username
            options["sasl_plain_password"] = k.sasl_password.get_secret_value()
    return options


def kafka_environment(settings: OutboxSettings) -> dict[str, str]:
    """The ``OUTBOX_KAFKA*`` variables that make a child process (a daemon started by a
    tool or a test) connect like ``settings``. Secrets are in clear: this is the child's
    configuration, to be passed as its environment, never printed."""
    env = {"OUTBOX_KAFKA_BOOTSTRAP_SERVERS": settings.kafka_bootstrap_servers}
    for name, value in settings.kafka:
        if value is None:
            continue
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        elif isinstance(value, dict):
            value = json.dumps(value)
        env[f"OUTBOX_KAFKA__{name.upper()}"] = str(value)
    return env


def _ssl_context(k: KafkaSettings) -> ssl.SSLContext:
    try:
        context = create_ssl_context(
            cafile=str(k.ssl_ca_file) if k.ssl_ca_file else None,
            certfile=str(k.ssl_cert_file) if k.ssl_cert_file else None,
            keyfile=str(k.ssl_key_file) if k.ssl_key_file else None,
            password=k.ssl_key_password.get_secret_value() if k.ssl_key_password else None,
        )
    except (OSError, ssl.SSLError) as exc:
        # Which file is named by the setting; the SSL library's reason says what is wrong.
        reason = getattr(exc, "reason", None) or type(exc).__name__
        raise ConfigurationError(
            "OUTBOX_KAFKA__SSL_CA_FILE / SSL_CERT_FILE / SSL_KEY_FILE (/ SSL_KEY_PASSWORD) "
            f"cannot be loaded: {reason}"
        ) from None
    context.check_hostname = k.ssl_check_hostname
    return context  # type: ignore[no-any-return]  # aiokafka is untyped


def _accepted(kind: type[Any]) -> frozenset[str]:
    return frozenset(inspect.signature(kind).parameters)


def _build(kind: type[Any], role: str, settings: OutboxSettings, options: dict[str, Any]) -> Any:
    k = settings.kafka
    # Extra options go beneath the caller's (acks, auto-commit... are correctness, not
    # tuning); each client takes the extras it knows. A client id set by the operator wins.
    extra = {name: v for name, v in k.options.items() if name in _accepted(kind)}
    chosen = {**kafka_options(settings), **extra, **options}
    if k.client_id:
        chosen["client_id"] = k.client_id
    try:
        return kind(**chosen)
    except (TypeError, ValueError) as exc:  # an unknown or impossible option
        raise ConfigurationError(f"invalid Kafka {role} option: {exc}") from None


def with_client_options(settings: OutboxSettings, options: Mapping[str, Any]) -> OutboxSettings:
    """``settings`` whose Kafka extras include ``options`` (e.g. a consumer's
    ``kafka_options``), so that they reach every client built from it — the consumer, its
    admin client and its dead-letter producer — each taking those it knows."""
    if not options:
        return settings
    k = settings.kafka
    kafka = k.model_copy(update={"options": {**k.options, **options}})
    return settings.model_copy(update={"kafka": kafka})


class _Startable(Protocol):
    async def start(self) -> None: ...


async def start_kafka(client: _Startable, settings: OutboxSettings) -> None:
    """``client.start()``; when it fails because a broker refused this client's security
    settings (credentials, certificate, protocol), :class:`BrokerRefused` instead of
    the generic connection error aiokafka raises after logging the reason."""
    try:
        await client.start()
    except (KafkaError, OSError, TimeoutError):
        refused = await security_refusal(settings)
        if refused is not None:
            raise refused from None
        raise


async def security_refusal(settings: OutboxSettings) -> BrokerRefused | None:
    """Connect once to the first bootstrap broker with the client's settings and tell a
    refusal for security reasons (None: connected, or failed for another reason, such as
    nobody listening)."""
    k = settings.kafka
    host, _, port = settings.kafka_bootstrap_servers.split(",")[0].strip().rpartition(":")
    options = kafka_options(settings)
    del options["bootstrap_servers"]
    timeout = _PROBE_SECONDS
    try:
        conn = await asyncio.wait_for(
            create_conn(host, int(port), request_timeout_ms=int(timeout * 1000), **options),
            timeout,
        )
    except (SaslAuthenticationFailed, AuthenticationFailedError):
        if k.sasl_oauth_token_provider is not None:
            return _refused(
                f"authentication failed (OAUTHBEARER, token from {k.sasl_oauth_token_provider})",
                "check the token it returns (expired? audience, scope, subject) and "
                "OUTBOX_KAFKA__SASL_OAUTH_TOKEN_PROVIDER",
            )
        return _refused(
            f"authentication failed ({k.sasl_mechanism} as user {k.sasl_username!r})",
            "check OUTBOX_KAFKA__SASL_USERNAME / SASL_PASSWORD / SASL_MECHANISM",
        )
    except UnsupportedSaslMechanismError:
        return _refused(
            f"SASL mechanism {k.sasl_mechanism} is not enabled on this listener",
            "check OUTBOX_KAFKA__SASL_MECHANISM",
        )
    except ssl.SSLCertVerificationError as exc:
        return _refused(
            f"certificate verify failed ({exc.verify_message})",
            "check OUTBOX_KAFKA__SSL_CA_FILE (the CA that signed the brokers' certificates) "
            "and OUTBOX_KAFKA__SSL_CHECK_HOSTNAME",
        )
    except ssl.SSLError as exc:
        return _refused(
            f"TLS handshake failed ({exc.reason or type(exc).__name__}): wrong protocol?",
            f"OUTBOX_KAFKA__SECURITY_PROTOCOL is {k.security_protocol}; the port may not speak TLS",
        )
    except TokenUnavailable:  # the identity provider's trouble, not a refusal: retried
        return None
    except TimeoutError:
        # Connected, and no answer at all: a broker that hangs (GC pause, stuck disk). Both
        # protocol mismatches get the connection closed at once (measured: within 0.1 s).
        return None
    except (KafkaConnectionError, ConnectionResetError):
        # Connected, then the broker hung up on the first bytes: a plaintext client
        # talking to a TLS listener, or the other way round.
        need = "a plaintext listener needs PLAINTEXT or SASL_PLAINTEXT"
        if not k.uses_tls:
            need = "a TLS listener needs SSL or SASL_SSL"
        return _refused(
            "the broker closed the connection on the first request: wrong protocol?",
            f"OUTBOX_KAFKA__SECURITY_PROTOCOL is {k.security_protocol}; {need}",
        )
    except (KafkaError, OSError):  # nobody listening, name not resolved...: not security
        return None
    conn.close()
    return None


def _refused(cause: str, hint: str) -> BrokerRefused:
    return BrokerRefused(f"Kafka refused the connection: {cause}; {hint}")


def kafka_producer(settings: OutboxSettings, **options: Any) -> AIOKafkaProducer:
    """An ``AIOKafkaProducer`` for ``settings`` (not started)."""
    producer: AIOKafkaProducer = _build(AIOKafkaProducer, "producer", settings, options)
    return producer


# A consumer's requests to a broker that hangs (a long GC pause, a stuck disk) wait this
# long, aiokafka's 40 s default being longer than the group session (10 s): a heartbeat
# stuck on a hung group coordinator for 40 s gets the member thrown out of the group by
# the new coordinator, and every partition stops for a rebalance. OUTBOX_KAFKA__OPTIONS
# (or the app's kafka_options) may set another.
CONSUMER_REQUEST_TIMEOUT_MS = 10_000


def kafka_consumer(settings: OutboxSettings, **options: Any) -> AIOKafkaConsumer:
    """An ``AIOKafkaConsumer`` for ``settings`` (not started); auto-commit is the caller's
    choice to refuse."""
    if "request_timeout_ms" not in settings.kafka.options:
        options.setdefault("request_timeout_ms", CONSUMER_REQUEST_TIMEOUT_MS)
    consumer: AIOKafkaConsumer = _build(AIOKafkaConsumer, "consumer", settings, options)
    return consumer


class MetadataWatch:
    """Keeps a Kafka client's view of who leads what fresh when a broker hangs.

    aiokafka's own refresh, and its choice of a broker for a coordinator lookup, take one
    broker at random and wait a whole request timeout when that one hangs: meanwhile the
    partitions Kafka moved away from it are still fetched from it, and a consumer whose
    group coordinator hung may look up the hung one again and be thrown out of the group.
    :meth:`refresh` asks the brokers one at a time, the one that answered last first, each
    for at most ``each_seconds``; the client's random choice becomes the broker that
    answered the last refresh, else one that did not fail to answer.

    ``owner`` is the consumer (or any aiokafka client); the requests go through
    :mod:`outbox.kafka_room`. Without its metadata capability (an aiokafka that changed
    the internals, said at start) a refresh is ``fallback()`` — a public request such as
    ``consumer.topics()`` — which tells an outage but leaves leadership to aiokafka."""

    def __init__(
        self,
        owner: Any,
        topics: Sequence[str],
        each_seconds: float,
        fallback: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self._owner = owner
        self._kafka = kafka_room.client_of(owner)
        self._topics = list(topics)
        self._each = each_seconds
        self._fallback = fallback
        self._answered: int | None = None
        self._silent: dict[int, float] = {}  # broker -> when it last failed to answer
        kafka_room.prefer_brokers(owner, lambda _client: self.pick())

    def _quiet(self) -> set[int]:
        """Brokers that failed to answer in the last SILENT_SECONDS."""
        since = time.monotonic() - self.SILENT_SECONDS
        return {n for n, at in self._silent.items() if at > since}

    SILENT_SECONDS = 30.0

    def pick(self) -> int | None:
        """Where aiokafka sends a group coordinator lookup. Heartbeats stop while the
        coordinator is unknown (after a commit timed out, say, waiting for a hung replica),
        and a lookup sent to a hung broker waits a whole request timeout: long enough for
        the group to drop this member (session 10 s) and rebalance. A broker that has not
        failed to answer yet may be the hung one; the one that answered the last refresh
        (a second ago) is not."""
        nodes = [b.nodeId for b in self._kafka.cluster.brokers()]
        quiet = self._quiet()
        if self._answered in nodes and self._answered not in quiet:
            return self._answered
        answering = [n for n in nodes if n not in quiet]
        return random.choice(answering or nodes) if nodes else None

    async def refresh(self) -> bool:
        """True when a broker answered (and the client's view was updated)."""
        if not kafka_room.usable(kafka_room.METADATA):
            return await self._refresh_publicly()
        quiet = self._quiet()
        nodes = [b.nodeId for b in self._kafka.cluster.brokers()]
        nodes.sort(key=lambda n: (n != self._answered, n in quiet))
        for node in nodes:
            try:
                response = await asyncio.wait_for(
                    kafka_room.ask_metadata(self._owner, node, self._topics), self._each
                )
            except kafka_room.MetadataUnavailable:
                return await self._refresh_publicly()
            except (KafkaError, OSError, TimeoutError):
                self._silent[node] = time.monotonic()
                continue
            if response.brokers:
                kafka_room.update_cluster(self._owner, response)
                self._answered = int(node)
                self._silent.pop(node, None)
                return True
        return False

    async def _refresh_publicly(self) -> bool:
        if self._fallback is None:
            return True  # nothing to ask: aiokafka's own refresh is all there is
        try:
            await asyncio.wait_for(self._fallback(), self._each * 3)
        except (KafkaError, OSError, TimeoutError):
            return False
        return True


def kafka_admin(settings: OutboxSettings, **options: Any) -> AIOKafkaAdminClient:
    """An ``AIOKafkaAdminClient`` for ``settings`` (not started)."""
    admin: AIOKafkaAdminClient = _build(AIOKafkaAdminClient, "admin", settings, options)
    return admin


# Answers after which retrying cannot help: wrong credentials or TLS setup, no permission.
_REFUSALS = (
    kerr.AuthenticationFailedError,
    kerr.AuthenticationMethodNotSupported,
    kerr.SaslAuthenticationFailed,
    kerr.UnsupportedSaslMechanismError,
    kerr.IllegalSaslStateError,
    kerr.ClusterAuthorizationFailedError,
    kerr.GroupAuthorizationFailedError,
    ssl.SSLError,
)


def kafka_refusal(exc: BaseException) -> BrokerRefused | None:
    """A :class:`BrokerRefused` (configuration: exit 2) when ``exc`` — or what caused it —
    is an authentication, authorization or TLS failure; None for anything worth retrying."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, _REFUSALS):
            detail = str(seen).splitlines()[0] if str(seen) else ""
            return BrokerRefused(
                f"Kafka refused the client: {type(seen).__name__}"
                + (f" ({detail})" if detail else "")
                + "; check the Kafka security settings"
            )
        seen = seen.__cause__ or seen.__context__
    return None


def raise_admin_failure(exc: BaseException) -> NoReturn:
    """Raise a failed admin request as the framework's error: the refusal it carries
    (configuration: exit 2, without aiokafka's chain), else Kafka unavailable (retried)."""
    refused = kafka_refusal(exc)
    if refused is not None:
        raise refused from None
    raise BrokerUnavailable(f"Kafka admin request failed: {type(exc).__name__}") from exc


UNKNOWN_TOPIC = 3  # the error code of a DescribeTopics answer for a topic that is not there


def partition_counts(described: Iterable[Any], names: Iterable[str]) -> dict[str, int | None]:
    """Partition count of each topic of a DescribeTopics answer; None when it is missing."""
    found: dict[str, int | None] = dict.fromkeys(names)
    for t in described:
        if t["error_code"] != UNKNOWN_TOPIC and t["partitions"]:
            found[t["topic"]] = len(t["partitions"])
    return found


def topic_error(response: Any, name: str) -> KafkaError | None:
    """The error a CreateTopics answer gives for ``name`` (aiokafka returns per-topic error
    codes instead of raising), or None."""
    for entry in response.topic_errors:
        topic, code = entry[0], entry[1]
        if topic == name and code != 0:
            message = entry[2] if len(entry) > 2 else None
            error: KafkaError = kerr.for_code(code)(message) if message else kerr.for_code(code)()
            return error
    return None


# --------------------------------------------------------------------- metrics and health


def supervise(
    task: asyncio.Task[Any], what: str, logger: logging.Logger, died: Callable[[], None]
) -> None:
    """Watch a background task that should only end when cancelled (a leader watch, a
    metadata watch, an offset committer): an exception ends it unobserved otherwise. Its
    death is logged at ERROR with the cause, and ``died()`` fails the daemon's health."""

    def done(finished: asyncio.Task[Any]) -> None:
        if finished.cancelled() or finished.exception() is None:
            return
        error = finished.exception()
        logger.error("%s died: %r", what, error, exc_info=error)
        died()

    task.add_done_callback(done)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds are not worth a log line."""


def serve_http(
    registry: CollectorRegistry,
    port: int,
    healthy: Callable[[], bool],
    *,
    name: str = "daemon-http",
) -> WSGIServer:
    """Serve ``/metrics`` and ``/healthz`` (200 when ``healthy()``, else 503) on a daemon
    thread; ``server.shutdown()`` stops it."""
    prometheus = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == "/healthz":
            ok = healthy()
            start("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [b"ok\n" if ok else b"unhealthy\n"]
        result: Iterable[bytes] = prometheus(environ, start)
        return result

    server = make_server("0.0.0.0", port, app, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
    return server


# ------------------------------------------------------------------------------ signals


@contextlib.contextmanager
def stop_on_signals(stop: Callable[[], None]) -> Iterator[None]:
    """Within the running event loop, SIGTERM and SIGINT call ``stop`` (a graceful stop:
    the daemon finishes or releases its in-flight batch) instead of killing the process."""
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop)
    try:
        yield
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


@contextlib.contextmanager
def early_stop_signals() -> Iterator[threading.Event]:
    """Before the event loop runs (imports, connecting), a signal must also mean "stop
    cleanly": the returned event is set and the daemon stops as soon as it starts."""
    early = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: early.set()) for sig in STOP_SIGNALS}
    try:
        yield early
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
