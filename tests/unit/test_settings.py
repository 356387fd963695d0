"""Settings: environment mapping, validation, and secrets kept out of text."""

from __future__ import annotations

import pytest

from outbox import ConfigurationError, InvalidIdentifier, load_settings


def test_env_prefix_and_nested_sections(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_DB_SCHEMA", "billing")
    monkeypatch.setenv("OUTBOX_RELAY__BATCH_SIZE", "2500")
    monkeypatch.setenv("OUTBOX_LANES", "128")
    s = load_settings()
    assert (s.db_schema, s.relay.batch_size, s.lanes) == ("billing", 2500, 128)


def test_password_never_rendered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql://app:s3cr3t-pw@db:5432/shop")
    s = load_settings()
    assert "s3cr3t-pw" not in repr(s) and "s3cr3t-pw" not in str(s)
    assert "s3cr3t-pw" not in s.safe_database_url
    assert s.sqlalchemy_url.drivername == "postgresql+psycopg"


def test_bad_dsn_error_does_not_echo_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "mysql://app:s3cr3t-pw@db/shop")
    with pytest.raises(ConfigurationError) as info:
        load_settings()
    assert "PostgreSQL" in str(info.value) and "s3cr3t-pw" not in str(info.value)
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "not a url s3cr3t-pw")
    with pytest.raises(ConfigurationError) as info:
        load_settings()
    assert "s3cr3t-pw" not in str(info.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("db_schema", "public; DROP TABLE x"),
        ("db_schema", "Upper"),
        ("table_prefix", "a-b"),
        ("db_schema", ""),
    ],
)
def test_identifiers_validated(field: str, value: str) -> None:
    with pytest.raises(InvalidIdentifier):
        load_settings(**{field: value})


def test_limits_validated() -> None:
    with pytest.raises(ConfigurationError, match="lanes"):
        load_settings(lanes=0)


def test_settings_are_frozen_and_hashable() -> None:
    s = load_settings()
    assert hash(s) == hash(load_settings())
    with pytest.raises(Exception):  # noqa: B017 - pydantic's frozen error type
        s.lanes = 3  # type: ignore[misc]
