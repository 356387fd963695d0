"""Static membership settings: the group instance id template and its session timeout."""

from __future__ import annotations

import pytest

from cli.consume import with_instance_id
from outbox import ConfigurationError, load_settings


def test_instance_id_unset_means_dynamic_membership() -> None:
    settings = load_settings()
    assert settings.consumer.group_instance_id is None
    assert settings.consumer.instance_id("orders-consumer-2") is None
    assert settings.consumer.static_session_timeout_ms == 45_000


@pytest.mark.parametrize(
    ("template", "host", "expected"),
    [
        ("{hostname}", "orders-consumer-2", "orders-consumer-2"),
        ("orders-{hostname}", "pod-0", "orders-pod-0"),
        ("{hostname}.{hostname}", "a", "a.a"),
        ("fixed_id-1", "ignored", "fixed_id-1"),
    ],
)
def test_hostname_is_the_only_field(template: str, host: str, expected: str) -> None:
    settings = load_settings(consumer={"group_instance_id": template})
    assert settings.consumer.instance_id(host) == expected


def test_instance_id_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_CONSUMER__GROUP_INSTANCE_ID", "shipping-{hostname}")
    monkeypatch.setenv("OUTBOX_CONSUMER__STATIC_SESSION_TIMEOUT_MS", "60000")
    settings = load_settings()
    assert settings.consumer.instance_id("web-1") == "shipping-web-1"
    assert settings.consumer.static_session_timeout_ms == 60_000


@pytest.mark.parametrize(
    ("template", "says"),
    [
        ("{host}", "only the field {hostname}"),
        ("{HOSTNAME}", "only the field {hostname}"),
        ("{hostname", "only the field {hostname}"),
        ("a}b", "only the field {hostname}"),
        ("{0}", "only the field {hostname}"),
        ("", "empty group instance id"),
        ("orders consumer", "' '"),
        ("orders/1", "'/'"),
        ("x" * 250, "longer than 249"),
    ],
)
def test_bad_template_is_a_typed_settings_error(template: str, says: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        load_settings(consumer={"group_instance_id": template})
    message = str(info.value)
    assert "consumer.group_instance_id" in message, message
    assert says in message, message


def test_a_host_name_that_makes_a_bad_id_is_a_configuration_error() -> None:
    settings = load_settings(consumer={"group_instance_id": "c-{hostname}"})
    with pytest.raises(ConfigurationError, match="the host name 'bad host'"):
        settings.consumer.instance_id("bad host")


@pytest.mark.parametrize("value", [0, 999, 3_600_001])
def test_static_session_timeout_bounds(value: int) -> None:
    with pytest.raises(ConfigurationError, match="static_session_timeout_ms"):
        load_settings(consumer={"static_session_timeout_ms": value})


def test_the_cli_option_is_validated_like_the_setting() -> None:
    settings = load_settings(consumer={"max_attempts": 7})
    chosen = with_instance_id(settings, "orders-{hostname}")
    assert chosen.consumer.group_instance_id == "orders-{hostname}"
    assert chosen.consumer.max_attempts == 7  # the rest of the section is kept
    assert with_instance_id(settings, None) is settings
    with pytest.raises(ConfigurationError, match=r"--instance-id: .*only the field \{hostname\}"):
        with_instance_id(settings, "{host}")
