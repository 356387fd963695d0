"""Kafka security settings: validation, the client options built from them, and secrets
kept out of every rendering of the settings."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.abc import AbstractTokenProvider
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaConnectionError
from pydantic import SecretStr

from outbox.errors import ConfigurationError
from outbox.kafka.aiokafka_internals import client_of
from outbox.kafka.clients import (
    kafka_admin,
    kafka_consumer,
    kafka_options,
    kafka_producer,
    with_client_options,
)
from outbox.kafka.oauthbearer import TokenUnavailable, token_provider
from outbox.settings import OutboxSettings, load_settings
from tests.support import oauth_tokens

PASSWORD = "unit-secret-Zq81"


def sasl_ssl(**kafka: object) -> OutboxSettings:
    return OutboxSettings(
        kafka={  # type: ignore[arg-type]
            "security_protocol": "SASL_SSL",
            "sasl_username": "svc-outbox",
            "sasl_password": PASSWORD,
            **kafka,
        }
    )


def test_defaults_are_plaintext_with_only_the_bootstrap_servers() -> None:
    s = OutboxSettings(kafka_bootstrap_servers="b1:9092,b2:9092")
    assert kafka_options(s) == {
        "bootstrap_servers": "b1:9092,b2:9092",
        "security_protocol": "PLAINTEXT",
    }


async def test_environment_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_KAFKA_BOOTSTRAP_SERVERS", "broker:9093")
    monkeypatch.setenv("OUTBOX_KAFKA__SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    monkeypatch.setenv("OUTBOX_KAFKA__SASL_MECHANISM", "SCRAM-SHA-256")
    monkeypatch.setenv("OUTBOX_KAFKA__SASL_USERNAME", "svc")
    monkeypatch.setenv("OUTBOX_KAFKA__SASL_PASSWORD", PASSWORD)
    monkeypatch.setenv("OUTBOX_KAFKA__CLIENT_ID", "billing")
    monkeypatch.setenv("OUTBOX_KAFKA__OPTIONS", '{"metadata_max_age_ms": 60000}')
    s = load_settings()
    options = kafka_options(s)
    assert options["bootstrap_servers"] == "broker:9093"
    assert options["sasl_mechanism"] == "SCRAM-SHA-256"
    assert options["sasl_plain_username"] == "svc"
    assert options["sasl_plain_password"] == PASSWORD
    assert "ssl_context" not in options
    producer = kafka_producer(s)
    assert producer.client._client_id == "billing"
    assert producer.client._metadata_max_age_ms == 60000


def test_sasl_ssl_gets_a_verifying_ssl_context_from_the_system_store(tmp_path: Path) -> None:
    options = kafka_options(sasl_ssl())
    context = options["ssl_context"]
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert options["security_protocol"] == "SASL_SSL"


def test_hostname_check_can_be_turned_off(tmp_path: Path) -> None:
    context = kafka_options(sasl_ssl(ssl_check_hostname=False))["ssl_context"]
    assert not context.check_hostname and context.verify_mode == ssl.CERT_REQUIRED


@pytest.mark.parametrize(
    ("kafka", "names"),
    [
        ({"security_protocol": "SASL_SSL"}, "sasl_username and sasl_password"),
        ({"security_protocol": "SASL_SSL", "sasl_username": "u"}, "sasl_password"),
        ({"security_protocol": "TLS"}, "kafka.security_protocol"),
        ({"sasl_mechanism": "GSSAPI"}, "kafka.sasl_mechanism"),
        (
            {"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER"},
            "needs sasl_oauth_token_provider",
        ),
        ({"sasl_oauth_token_provider": "tokens:valid"}, "with sasl_mechanism OAUTHBEARER"),
        (
            {"sasl_mechanism": "OAUTHBEARER", "sasl_oauth_token_provider": "no-colon"},
            "is MODULE:ATTR",
        ),
        ({"sasl_mechanism": "OAUTHBEARER", "sasl_oauth_token_provider": "mod:"}, "MODULE:ATTR"),
        ({"ssl_ca_file": "/no/such/ca.pem"}, "kafka.ssl_ca_file"),
        ({"options": {"sasl_plain_password": PASSWORD}}, "kafka.options"),
        ({"options": {"bootstrap_servers": "x:1"}}, "own setting"),
    ],
)
def test_bad_settings_are_a_configuration_error_naming_the_setting(
    kafka: dict[str, object], names: str
) -> None:
    with pytest.raises(ConfigurationError, match=names) as caught:
        load_settings(kafka=kafka)
    assert PASSWORD not in str(caught.value)
    assert "/no/such" not in str(caught.value)


async def test_an_unloadable_ca_file_is_a_configuration_error(tmp_path: Path) -> None:
    garbage = tmp_path / "ca.pem"
    garbage.write_text("not a certificate\n" + PASSWORD)
    s = sasl_ssl(ssl_ca_file=garbage)
    with pytest.raises(ConfigurationError, match="SSL_CA_FILE") as caught:
        kafka_producer(s)
    assert PASSWORD not in str(caught.value)


def test_secrets_are_masked_in_repr_and_dump(tmp_path: Path) -> None:
    s = sasl_ssl(ssl_key_password="key-" + PASSWORD)
    for shown in (repr(s), str(s), s.model_dump_json(), str(s.model_dump(mode="json"))):
        assert PASSWORD not in shown
    assert "svc-outbox" in repr(s)


async def test_every_client_gets_the_security_options(tmp_path: Path) -> None:
    s = sasl_ssl()
    producer = kafka_producer(s)
    consumer = kafka_consumer(s, group_id=None)
    admin = kafka_admin(s)
    assert isinstance(producer, AIOKafkaProducer) and isinstance(consumer, AIOKafkaConsumer)
    assert isinstance(admin, AIOKafkaAdminClient)
    for client in map(client_of, (producer, consumer, admin)):
        assert client._security_protocol == "SASL_SSL"
        assert client._sasl_plain_password == PASSWORD
        assert isinstance(client._ssl_context, ssl.SSLContext)


async def test_a_consumers_options_reach_its_admin_client_and_dlq_producer(tmp_path: Path) -> None:
    """Options given in code (Consumer(kafka_options=...)) are folded into the settings,
    and each client takes those it knows: a consumer-only option stays off the admin."""
    s = with_client_options(
        OutboxSettings(),
        {"metadata_max_age_ms": 1234, "max_poll_records": 7, "client_id": "inbox-x"},
    )
    admin = kafka_admin(s)
    producer = kafka_producer(s)
    consumer = kafka_consumer(s, group_id=None)
    assert client_of(admin)._metadata_max_age_ms == 1234
    assert producer.client._metadata_max_age_ms == 1234
    assert consumer._max_poll_records == 7
    assert client_of(admin)._client_id == "inbox-x"


def test_the_safe_database_url_masks_a_tls_key_password() -> None:
    s = OutboxSettings(
        database_url=SecretStr(  # type: ignore[arg-type]
            f"postgresql+psycopg://u:{PASSWORD}@db/app?sslmode=verify-full&sslpassword={PASSWORD}"
        )
    )
    assert PASSWORD not in s.safe_database_url
    assert "sslmode=verify-full" in s.safe_database_url


def oauth(provider: str) -> OutboxSettings:
    return OutboxSettings(
        kafka={  # type: ignore[arg-type]
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "OAUTHBEARER",
            "sasl_oauth_token_provider": provider,
        }
    )


def test_oauthbearer_clients_share_the_named_token_provider() -> None:
    options = kafka_options(oauth("tests.support.oauth_tokens:valid"))
    assert options["sasl_mechanism"] == "OAUTHBEARER"
    assert options["sasl_oauth_token_provider"].provider is oauth_tokens.valid
    assert "sasl_plain_username" not in options and "sasl_plain_password" not in options
    # a class (or function) is called once per process: every client shares its token cache
    made = token_provider("tests.support.oauth_tokens:Expired")
    assert isinstance(made.provider, oauth_tokens.Expired)
    assert (
        kafka_options(oauth("tests.support.oauth_tokens:Expired"))["sasl_oauth_token_provider"]
        is made
    )


class _Failing(AbstractTokenProvider):
    async def token(self) -> str:
        raise RuntimeError("identity provider answered 503")


failing = _Failing()


async def test_a_failing_provider_is_a_connection_error_to_aiokafka() -> None:
    # aiokafka retries connection errors; anything else would end its background task.
    guarded = token_provider("tests.unit.test_kafka_security_settings:failing")
    with pytest.raises(TokenUnavailable, match="RuntimeError: identity provider answered 503"):
        await guarded.token()
    assert issubclass(TokenUnavailable, KafkaConnectionError)


@pytest.mark.parametrize(
    ("target", "says"),
    [
        ("no_such_module_xyz:provider", "cannot import 'no_such_module_xyz'"),
        ("tests.support.oauth_tokens:missing", "has no attribute 'missing'"),
        ("tests.support.oauth_tokens:not_a_provider", "not an aiokafka.abc.AbstractTokenProvider"),
    ],
)
def test_a_token_provider_that_cannot_be_used_is_a_configuration_error(
    target: str, says: str
) -> None:
    with pytest.raises(ConfigurationError, match="OUTBOX_KAFKA__SASL_OAUTH_TOKEN_PROVIDER") as e:
        kafka_producer(oauth(target))
    assert says in str(e.value)
