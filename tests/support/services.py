"""Finding PostgreSQL and Kafka for the test run.

Order: URLs in the environment (OUTBOX_DATABASE_URL + OUTBOX_KAFKA_BOOTSTRAP_SERVERS) →
testcontainers when a Docker engine answers → the native services of scripts/services.
A service that cannot be reached fails the run with a message saying what to run; it is
never skipped.

The secured endpoints of the security tests (Kafka SASL_SSL, PostgreSQL TLS, the test CA
and certificates) come the same way: the OUTBOX_TEST_* variables in the environment when the
plain endpoints do — or, when only the plain ones are there (``eval "$(scripts/services
env)"`` exports no test credential into a shell), the ``scripts/services env --test`` lines
of the same native services —, else the export lines of the native ``scripts/services up
--test``. Testcontainers has none; ``Endpoints.require_secured()`` then fails the test,
saying why.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parents[2]
HINT = (
    "start them with `scripts/services up` "
    "(or set OUTBOX_DATABASE_URL and OUTBOX_KAFKA_BOOTSTRAP_SERVERS)"
)


class ServiceUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class Secured:
    """The secured test services of ``scripts/services`` (see its OUTBOX_TEST_* lines)."""

    kafka_sasl_ssl: str  # host:port of the SASL_SSL listener (SCRAM-SHA-512/256, PLAIN)
    kafka_user: str
    kafka_password: str = field(repr=False)
    ca_file: Path  # signs the broker's and PostgreSQL's certificates, and the client's
    untrusted_ca_file: Path  # a CA that signed none of them
    client_cert_file: Path  # CN=outbox, signed by ca_file
    client_key_file: Path
    pg_tls_url: str = field(repr=False)  # sslmode=verify-full against ca_file

    VARS: ClassVar[dict[str, str]] = {
        "kafka_sasl_ssl": "OUTBOX_TEST_KAFKA_SASL_SSL",
        "kafka_user": "OUTBOX_TEST_KAFKA_USER",
        "kafka_password": "OUTBOX_TEST_KAFKA_PASSWORD",
        "ca_file": "OUTBOX_TEST_TLS_CA",
        "untrusted_ca_file": "OUTBOX_TEST_TLS_UNTRUSTED_CA",
        "client_cert_file": "OUTBOX_TEST_TLS_CLIENT_CERT",
        "client_key_file": "OUTBOX_TEST_TLS_CLIENT_KEY",
        "pg_tls_url": "OUTBOX_TEST_PG_TLS_URL",
    }

    @classmethod
    def parse(cls, values: Mapping[str, str]) -> Secured | str:
        """The secured endpoints named in ``values``, or why there are none."""
        missing = [var for var in cls.VARS.values() if not values.get(var)]
        if missing:
            return f"{', '.join(missing)} not set"
        # `export $(scripts/services env --test | sed 's/export //')` keeps the shell quotes
        # that protect the DSN's '&'; take them off the way a shell would.
        got = {name: _unquote(values[var]) for name, var in cls.VARS.items()}
        paths = {
            name: Path(got[name])
            for name in ("ca_file", "untrusted_ca_file", "client_cert_file", "client_key_file")
        }
        unreadable = [str(p) for p in paths.values() if not p.is_file()]
        if unreadable:
            return f"TLS files not found: {', '.join(unreadable)}"
        return cls(
            kafka_sasl_ssl=got["kafka_sasl_ssl"],
            kafka_user=got["kafka_user"],
            kafka_password=got["kafka_password"],
            pg_tls_url=got["pg_tls_url"],
            **paths,
        )

    def verify_full(self, database_url: str, ca_file: Path | None = None) -> str:
        """``database_url`` (e.g. the session database) over TLS with sslmode=verify-full."""
        query = {"sslmode": "verify-full", "sslrootcert": str(ca_file or self.ca_file)}
        url = make_url(database_url).update_query_dict(query)
        return url.render_as_string(hide_password=False)


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return shlex.split(value)[0]
    return value


@dataclass(frozen=True)
class Endpoints:
    database_url: str
    kafka_bootstrap: str
    how: str
    # The parsed secured endpoints, or why there are none.
    secured: Secured | str = "not asked for"

    def require_secured(self) -> Secured:
        """The secured endpoints; ServiceUnavailable (a test failure, not a skip) if absent."""
        if isinstance(self.secured, str):
            raise ServiceUnavailable(
                f"the secured test services (Kafka SASL_SSL, PostgreSQL TLS) are missing "
                f"({self.how}: {self.secured}); start them with `scripts/services up` and "
                "take the OUTBOX_TEST_* lines of `scripts/services env --test` into the "
                "environment"
            )
        if not _reachable(self.secured.kafka_sasl_ssl):
            raise ServiceUnavailable(
                f"the Kafka SASL_SSL listener {self.secured.kafka_sasl_ssl} is not reachable; "
                "a broker started by an older scripts/services lacks it: "
                "scripts/services kafka-stop && scripts/services kafka-start"
            )
        return self.secured


def _docker_engine() -> bool:
    if not shutil.which("docker"):
        return False
    probe = subprocess.run(["docker", "info"], capture_output=True, timeout=20, check=False)
    return probe.returncode == 0


@contextmanager
def _containers() -> Iterator[Endpoints]:
    from testcontainers.kafka import KafkaContainer
    from testcontainers.postgres import PostgresContainer

    with ExitStack() as stack:
        pg = stack.enter_context(PostgresContainer("postgres:15", driver="psycopg"))
        # testcontainers' KafkaContainer drives Confluent images: 7.9 is Apache Kafka 3.9
        # in KRaft mode (the native services and docker-compose.yml run Kafka 4.1).
        kafka = stack.enter_context(KafkaContainer("confluentinc/cp-kafka:7.9.0").with_kraft())
        yield Endpoints(
            pg.get_connection_url(),
            kafka.get_bootstrap_server(),
            "testcontainers",
            "testcontainers runs no secured services",
        )


def _services(*args: str) -> dict[str, str]:
    """The variables ``scripts/services ARGS`` exports."""
    script = ROOT / "scripts" / "services"
    proc = subprocess.run([str(script), *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ServiceUnavailable(
            f"scripts/services {' '.join(args)} failed (exit {proc.returncode}):\n"
            f"{proc.stderr[-2000:]}"
        )
    return dict(
        shlex.split(line)[1].split("=", 1)
        for line in proc.stdout.splitlines()
        if line.startswith("export ")
    )


def _secured_of_the_environment(database_url: str) -> Secured | str:
    """The OUTBOX_TEST_* variables of the environment, or else, when its database is the
    native services' own, those services' secured endpoints."""
    secured = Secured.parse(os.environ)
    if not isinstance(secured, str):
        return secured
    try:
        native = _services("env", "--test")
    except ServiceUnavailable:
        return secured
    if native.get("OUTBOX_DATABASE_URL") != database_url:
        return secured  # services of someone else's: their test endpoints are not known
    return Secured.parse(native)


def _native() -> Endpoints:
    env = _services("up", "--test")
    return Endpoints(
        env["OUTBOX_DATABASE_URL"],
        env["OUTBOX_KAFKA_BOOTSTRAP_SERVERS"],
        "native",
        Secured.parse(env),
    )


def _reachable(host_port: str) -> bool:
    host, _, port = host_port.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=3) as sock:
            # Nobody listening on a loopback port of the ephemeral range, the kernel may pick
            # that very port as the source and connect the socket to itself.
            return bool(sock.getsockname() != sock.getpeername())
    except OSError:
        return False


@contextmanager
def endpoints() -> Iterator[Endpoints]:
    url = os.environ.get("OUTBOX_DATABASE_URL")
    kafka = os.environ.get("OUTBOX_KAFKA_BOOTSTRAP_SERVERS")
    if url and kafka:
        found = Endpoints(url, kafka, "environment", _secured_of_the_environment(url))
    elif _docker_engine():
        with _containers() as found:
            yield found
        return
    else:
        found = _native()
    for server in found.kafka_bootstrap.split(","):
        if not _reachable(server):
            raise ServiceUnavailable(f"Kafka at {server} ({found.how}) is not reachable; {HINT}")
    yield found
