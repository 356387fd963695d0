"""The secured test services themselves (scripts/services): the broker's SASL_SSL listener
and PostgreSQL's TLS accept the right client and refuse the wrong ones, for the reason
expected. The library's own security settings are tested elsewhere; these tests talk to the
services with aiokafka and psycopg directly, so a failure here points at the services."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError
from aiokafka.helpers import create_ssl_context
from sqlalchemy.engine import make_url

from tests.support.services import Secured

pytestmark = pytest.mark.integration


def sasl_ssl(
    secured: Secured,
    mechanism: str = "SCRAM-SHA-512",
    password: str | None = None,
    ca_file: Path | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """aiokafka client options for the SASL_SSL listener."""
    return {
        "bootstrap_servers": secured.kafka_sasl_ssl,
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": mechanism,
        "sasl_plain_username": secured.kafka_user,
        "sasl_plain_password": secured.kafka_password if password is None else password,
        "ssl_context": create_ssl_context(cafile=str(ca_file or secured.ca_file), **extra),
        "request_timeout_ms": 10_000,
    }


def libpq(url: str) -> str:
    """A SQLAlchemy URL (postgresql+psycopg://) as a libpq connection string."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


async def test_scram_sha_512_round_trip_over_sasl_ssl(secured: Secured) -> None:
    topic = f"secured-{uuid.uuid4().hex[:12]}"
    admin = AIOKafkaAdminClient(**sasl_ssl(secured))
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 1, 1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(**sasl_ssl(secured), acks="all", enable_idempotence=True)
    await producer.start()
    try:
        meta = await producer.send_and_wait(topic, b"over tls", key=b"k")
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(
        topic,
        **sasl_ssl(secured),
        group_id=f"g-{topic}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    try:
        batch = await consumer.getmany(timeout_ms=15_000)
        await consumer.commit()
    finally:
        await consumer.stop()
    got = [(m.offset, m.key, m.value) for msgs in batch.values() for m in msgs]
    assert got == [(meta.offset, b"k", b"over tls")]


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "PLAIN"])
async def test_other_mechanisms_authenticate(secured: Secured, mechanism: str) -> None:
    producer = AIOKafkaProducer(**sasl_ssl(secured, mechanism))
    await producer.start()
    try:
        assert producer.client.cluster.brokers(), "no broker metadata over SASL_SSL"
    finally:
        await producer.stop()


async def test_client_certificate_signed_by_the_ca_is_accepted(secured: Secured) -> None:
    options = sasl_ssl(
        secured,
        certfile=str(secured.client_cert_file),
        keyfile=str(secured.client_key_file),
    )
    producer = AIOKafkaProducer(**options)
    await producer.start()
    await producer.stop()


async def refused(options: dict[str, Any], caplog: pytest.LogCaptureFixture) -> str:
    """Start a producer that must not get in; the reason aiokafka logged for it."""
    producer = AIOKafkaProducer(**options)
    with caplog.at_level(logging.ERROR, logger="aiokafka"), pytest.raises(KafkaConnectionError):
        await producer.start()
    await producer.stop()
    return "\n".join(r.getMessage() for r in caplog.records)


async def test_wrong_password_is_an_authentication_failure(
    secured: Secured, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = "not-the-password-5Hv"
    why = await refused(sasl_ssl(secured, password=wrong), caplog)
    assert "SaslAuthenticationFailed" in why and "invalid credentials" in why, why
    assert wrong not in why and secured.kafka_password not in why


async def test_untrusted_ca_fails_certificate_verification(
    secured: Secured, caplog: pytest.LogCaptureFixture
) -> None:
    why = await refused(sasl_ssl(secured, ca_file=secured.untrusted_ca_file), caplog)
    assert "CERTIFICATE_VERIFY_FAILED" in why, why


async def test_plaintext_client_against_the_tls_port_is_refused(
    secured: Secured, caplog: pytest.LogCaptureFixture
) -> None:
    options = {"bootstrap_servers": secured.kafka_sasl_ssl, "request_timeout_ms": 10_000}
    why = await refused(options, caplog)
    assert "closed" in why, why


def test_postgres_verify_full_uses_tls(secured: Secured) -> None:
    with psycopg.connect(libpq(secured.pg_tls_url), connect_timeout=10) as conn:
        assert conn.info.pgconn.ssl_in_use
        row = conn.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone()
    assert row == (True,)


def test_postgres_client_certificate_is_verified_and_seen(secured: Secured) -> None:
    url = libpq(secured.pg_tls_url)
    dsn = f"{url}&sslcert={secured.client_cert_file}&sslkey={secured.client_key_file}"
    with psycopg.connect(dsn, connect_timeout=10) as conn:
        row = conn.execute("SELECT client_dn FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        (client_dn,) = row.fetchone() or ("",)
    assert "CN=outbox" in client_dn


def test_postgres_verify_full_refuses_an_untrusted_ca(secured: Secured) -> None:
    url = libpq(secured.verify_full(secured.pg_tls_url, secured.untrusted_ca_file))
    with pytest.raises(psycopg.OperationalError, match="certificate verify failed"):
        psycopg.connect(url, connect_timeout=10).close()


def test_postgres_plain_connections_keep_working(secured: Secured) -> None:
    url = make_url(libpq(secured.pg_tls_url)).difference_update_query(["sslmode", "sslrootcert"])
    dsn = url.update_query_dict({"sslmode": "disable"}).render_as_string(hide_password=False)
    with psycopg.connect(dsn, connect_timeout=10) as conn:
        assert not conn.info.pgconn.ssl_in_use
