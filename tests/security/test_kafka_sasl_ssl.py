"""The daemons and operator tools over Kafka SASL_SSL + SCRAM-SHA-512 (the test services'
secured listener), and the three ways a client is refused: a wrong password, an untrusted
CA, a plaintext client on the TLS port — each a clear, typed error naming the cause without
the password, and a daemon that exits (code 2) instead of retrying forever."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import pytest
from aiokafka.admin import NewTopic
from sqlalchemy import Engine, text

from outbox import Message, Outbox, migrate
from outbox.errors import ConfigurationError, ConnectionRefused
from outbox.kafka.clients import kafka_admin, kafka_consumer, kafka_producer, start_kafka
from outbox.ops.kafka_probe import KafkaProbe
from outbox.settings import KafkaSettings, OutboxSettings
from tests.security.conftest import Daemon, cli, run_daemon, sasl_ssl, secret, until
from tests.support.services import Secured

pytestmark = pytest.mark.integration

WRONG = "wrong-password-Vb72"


async def create_topic(settings: OutboxSettings, partitions: int = 3) -> str:
    name = f"sec-{uuid.uuid4().hex[:10]}"
    admin = kafka_admin(settings)
    await start_kafka(admin, settings)
    try:
        await admin.create_topics([NewTopic(name, partitions, 1)])
    finally:
        await admin.close()
    return name


async def read_topic(settings: OutboxSettings, topic: str, expect: int) -> list[dict[str, bytes]]:
    """Headers of the first ``expect`` records of ``topic``, read over ``settings``."""
    consumer = kafka_consumer(settings, group_id=None, auto_offset_reset="earliest")
    consumer.subscribe([topic])
    await start_kafka(consumer, settings)
    got: list[dict[str, bytes]] = []
    try:
        for _ in range(60):
            batch = await consumer.getmany(timeout_ms=500)
            got += [dict(m.headers) for msgs in batch.values() for m in msgs]
            if len(got) >= expect:
                break
    finally:
        await consumer.stop()
    return got


def count(engine: Engine, sql: str, **params: object) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(sql), params).scalar_one())


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-512", "OAUTHBEARER"])
async def test_round_trip_producer_relay_consumer_dlq_lag_doctor(
    base_settings: OutboxSettings,
    secured: Secured,
    engine: Engine,
    daemons: list[Daemon],
    tmp_path: Path,
    mechanism: str,
) -> None:
    s = sasl_ssl(
        base_settings, secured, mechanism=mechanism, table_prefix=f"s{uuid.uuid4().hex[:8]}_"
    )
    migrate.upgrade(s)
    topic = await create_topic(s)
    consumer = f"sec-consumer-{uuid.uuid4().hex[:6]}"
    effects = f"sec_effects_{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {effects} (event_id text PRIMARY KEY, n int)"))
    ob = Outbox(s)
    with engine.begin() as conn:
        ids = ob.publish_many(
            conn,
            [
                Message(topic=topic, key=f"k{n % 5}", event_type="sec.order", payload={"n": n})
                for n in range(40)
            ],
        )
        poison = ob.publish(
            conn, topic=topic, key="k0", event_type="sec.order", payload={"poison": True}
        )

    relay = run_daemon(daemons, s, tmp_path, "relay")
    app_env = {
        "SECURED_TEST_CONSUMER": consumer,
        "SECURED_TEST_TOPIC": topic,
        "SECURED_TEST_EFFECTS": effects,
    }
    consume = run_daemon(
        daemons, s, tmp_path, "consume", "tests.support.secured_apps:app", **app_env
    )

    dead = (
        f'SELECT count(*) FROM "{s.db_schema}"."{s.table_prefix}dead_letters" WHERE consumer = :c'
    )
    until(
        lambda: (
            count(engine, f"SELECT count(*) FROM {effects}") == len(ids)
            and count(engine, dead, c=consumer) == 1
        ),
        90,
        f"40 effects and 1 dead letter (relay: {relay.output()[-2000:]}\n"
        f"consumer: {consume.output()[-2000:]})",
    )
    # the dead letter reached the DLQ topic over SASL_SSL, with the poison event's id
    dlq = await read_topic(s, topic + s.consumer.dlq_suffix, 1)
    assert [h["ce_id"].decode() for h in dlq] == [str(poison)]
    published = f'SELECT count(*) FROM "{s.db_schema}"."{s.table_prefix}events"'
    assert count(engine, published) == 0  # every row published and deleted

    # lag: the consumer group caught up (asked of Kafka over SASL_SSL)
    def caught_up() -> bool:
        proc = cli(s, "lag", "--json", "--group", consumer)
        assert proc.returncode == 0, proc.stderr
        group = {g["group"]: g for g in json.loads(proc.stdout)["groups"]}[consumer]
        return group["error"] is None and group["total_lag"] == 0 and group["dead_letters"] == 1

    until(caught_up, 60, "consumer lag 0 in `outbox lag`")

    doctor = cli(s, "doctor", "--json", "--topic", f"{topic}:3")
    findings = json.loads(doctor.stdout)
    kafka = [f for f in findings if f["check"] == "kafka"]
    assert kafka and kafka[0]["level"] == "ok", doctor.stdout
    tls = {f["details"]["service"]: f for f in findings if f["check"] == "tls"}
    assert tls["kafka"]["details"]["tls"] is True
    assert f"SASL_SSL ({mechanism})" in tls["kafka"]["what"]
    assert any(f["check"] == "topic" and f["level"] == "ok" for f in findings), doctor.stdout

    assert relay.stop() == 0 and consume.stop() == 0


# ------------------------------------------------------------------------ refusals

CASES = {
    "wrong password": ("authentication failed", {"password": WRONG}),
    "untrusted CA": ("certificate verify failed", {"ca_file": "untrusted"}),
    "plaintext on the TLS port": ("wrong protocol?", {"plaintext": True}),
    "expired OAUTHBEARER token": (
        "authentication failed (OAUTHBEARER",
        {"token_provider": "tests.support.oauth_tokens:Expired"},
    ),
}


def refused_settings(base: OutboxSettings, secured: Secured, case: str) -> OutboxSettings:
    _, how = CASES[case]
    prefix = {"table_prefix": f"r{uuid.uuid4().hex[:8]}_"}
    if how.get("plaintext"):
        return base.model_copy(
            update={"kafka_bootstrap_servers": secured.kafka_sasl_ssl, "kafka": KafkaSettings()}
            | prefix
        )
    if how.get("token_provider"):
        return sasl_ssl(
            base, secured, mechanism="OAUTHBEARER", token_provider=how["token_provider"], **prefix
        )
    ca = secured.untrusted_ca_file if how.get("ca_file") else None
    return sasl_ssl(base, secured, password=how.get("password"), ca_file=ca, **prefix)


@pytest.mark.parametrize("case", list(CASES))
async def test_a_refused_client_gets_a_typed_error_naming_the_cause(
    base_settings: OutboxSettings, secured: Secured, case: str
) -> None:
    s = refused_settings(base_settings, secured, case)
    cause = CASES[case][0]
    producer = kafka_producer(s, request_timeout_ms=5000)
    with pytest.raises(ConnectionRefused) as caught:
        await start_kafka(producer, s)
    await producer.stop()
    assert isinstance(caught.value, ConfigurationError) and not caught.value.retriable
    assert cause in str(caught.value) and caught.value.service == "Kafka"
    assert secured.kafka_password not in str(caught.value) and WRONG not in str(caught.value)
    # the operator tools say the same
    with pytest.raises(ConnectionRefused, match=re.escape(cause)):
        async with KafkaProbe(s):
            pass


def relay_and_consumer(daemons: list[Daemon], s: OutboxSettings, tmp_path: Path) -> list[Daemon]:
    """The relay and a consumer started with ``s``, expected to refuse to run."""
    return [
        run_daemon(daemons, s, tmp_path, "relay"),
        run_daemon(
            daemons,
            s,
            tmp_path,
            "consume",
            "tests.support.secured_apps:app",
            SECURED_TEST_CONSUMER=f"refused-{uuid.uuid4().hex[:6]}",
            SECURED_TEST_TOPIC="refused-topic",
            SECURED_TEST_EFFECTS="unused",
        ),
    ]


@pytest.mark.parametrize("case", list(CASES))
def test_daemons_exit_with_the_cause_instead_of_retrying(
    base_settings: OutboxSettings,
    secured: Secured,
    daemons: list[Daemon],
    tmp_path: Path,
    case: str,
) -> None:
    s = refused_settings(base_settings, secured, case)
    migrate.upgrade(s)
    cause = CASES[case][0]
    for daemon in relay_and_consumer(daemons, s, tmp_path):
        code = daemon.wait(90)
        out = daemon.output()
        assert code == 2, f"{daemon.args[0]} still running or exit {code}:\n{out[-3000:]}"
        assert "Kafka refused the connection" in out and cause in out, out[-3000:]
    doctor = cli(s, "doctor", "--json")
    kafka = [f for f in json.loads(doctor.stdout) if f["check"] == "kafka"]
    assert kafka[0]["level"] == "error" and cause in kafka[0]["what"], doctor.stdout
    ensure = cli(s, "topics", "ensure", "--topic", "refused-topic")
    assert ensure.returncode == 2 and cause in ensure.stderr, ensure.stderr


def test_a_token_provider_that_cannot_be_loaded_stops_the_daemons_at_once(
    base_settings: OutboxSettings, secured: Secured, daemons: list[Daemon], tmp_path: Path
) -> None:
    s = sasl_ssl(
        base_settings,
        secured,
        mechanism="OAUTHBEARER",
        token_provider="tests.support.oauth_tokens:not_a_provider",
    )
    for daemon in relay_and_consumer(daemons, s, tmp_path):
        assert daemon.wait(30) == 2, daemon.output()[-3000:]
        out = daemon.output()
        assert "OUTBOX_KAFKA__SASL_OAUTH_TOKEN_PROVIDER" in out and "AbstractTokenProvider" in out
        # before it takes lanes or joins a group
        assert "acquired lanes" not in out and "assigned" not in out, out[-3000:]


def test_secrets_stay_out_of_config_show(sasl_settings: OutboxSettings, secured: Secured) -> None:
    key_password = secret(f"key-pw-{uuid.uuid4().hex[:8]}")
    proc = cli(sasl_settings, "config", "show", OUTBOX_KAFKA__SSL_KEY_PASSWORD=key_password)
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)["kafka"]
    assert shown["sasl_password"] == "**********" and shown["ssl_key_password"] == "**********"
    assert shown["security_protocol"] == "SASL_SSL"
    assert secured.kafka_password not in proc.stdout and key_password not in proc.stdout
