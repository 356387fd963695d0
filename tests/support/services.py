"""Finding PostgreSQL and Kafka for the test run.

Order: URLs in the environment (OUTBOX_DATABASE_URL + OUTBOX_KAFKA_BOOTSTRAP_SERVERS) →
testcontainers when a Docker engine answers → the native services of scripts/services.
A service that cannot be reached fails the run with a message saying what to run; it is
never skipped.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HINT = (
    "start them with `scripts/services up` "
    "(or set OUTBOX_DATABASE_URL and OUTBOX_KAFKA_BOOTSTRAP_SERVERS)"
)


class ServiceUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class Endpoints:
    database_url: str
    kafka_bootstrap: str
    how: str


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
        yield Endpoints(pg.get_connection_url(), kafka.get_bootstrap_server(), "testcontainers")


def _native() -> Endpoints:
    script = ROOT / "scripts" / "services"
    proc = subprocess.run([str(script), "up"], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ServiceUnavailable(
            f"scripts/services up failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
        )
    env = dict(
        line.removeprefix("export ").split("=", 1)
        for line in proc.stdout.splitlines()
        if line.startswith("export ")
    )
    return Endpoints(env["OUTBOX_DATABASE_URL"], env["OUTBOX_KAFKA_BOOTSTRAP_SERVERS"], "native")


def _reachable(host_port: str) -> bool:
    host, _, port = host_port.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=3):
            return True
    except OSError:
        return False


@contextmanager
def endpoints() -> Iterator[Endpoints]:
    url = os.environ.get("OUTBOX_DATABASE_URL")
    kafka = os.environ.get("OUTBOX_KAFKA_BOOTSTRAP_SERVERS")
    if url and kafka:
        found = Endpoints(url, kafka, "environment")
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
