"""The Kafka section of the settings (``OUTBOX_KAFKA__*``): how every Kafka client of the
project connects. Part of :class:`outbox.settings.OutboxSettings` (imported from there)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"]

# Options the dedicated fields own: an extra option may not set them (secrets stay in
# SecretStr fields, so they are masked wherever settings are shown).
_OWNED_OPTIONS = ("bootstrap_servers", "security_protocol", "client_id")
_OWNED_PREFIXES = ("sasl_", "ssl_")


class KafkaSettings(BaseModel):
    """How every Kafka client of the project connects (TLS, SASL, client id).

    The broker list stays ``OUTBOX_KAFKA_BOOTSTRAP_SERVERS``. OAUTHBEARER takes its tokens
    from the deployment's own code, named as ``MODULE:ATTR`` (an environment variable cannot
    hold a token provider, and a fixed token would expire).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    security_protocol: SecurityProtocol = Field(
        "PLAINTEXT",
        description="PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL (managed clusters: SASL_SSL).",
    )
    sasl_mechanism: SaslMechanism = Field(
        "SCRAM-SHA-512",
        description="PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER (SASL_* only).",
    )
    sasl_username: str | None = Field(None, description="SASL user (API key on Confluent Cloud).")
    sasl_password: SecretStr | None = Field(
        None, description="SASL password (API secret); never shown or logged."
    )
    sasl_oauth_token_provider: str | None = Field(
        None,
        description="OAUTHBEARER: `MODULE:ATTR` of an aiokafka `AbstractTokenProvider` (an "
        "instance, or a class or function returning one), e.g. for MSK IAM or OIDC.",
    )
    ssl_ca_file: Path | None = Field(
        None,
        description="PEM file of the CA(s) that signed the brokers' certificates "
        "(unset: the system's trust store).",
    )
    ssl_cert_file: Path | None = Field(
        None, description="PEM client certificate, for brokers that require mutual TLS."
    )
    ssl_key_file: Path | None = Field(None, description="PEM private key of ssl_cert_file.")
    ssl_key_password: SecretStr | None = Field(
        None, description="Password of an encrypted ssl_key_file; never shown or logged."
    )
    ssl_check_hostname: bool = Field(
        True, description="Check that a broker's certificate names the host connected to."
    )
    client_id: str | None = Field(
        None, description="Kafka client id of every client (quotas, ACL audit); unset: per role."
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Further aiokafka client options as JSON, e.g. "
        '`{"metadata_max_age_ms": 60000}`; each client takes those it knows.',
    )

    @field_validator("ssl_ca_file", "ssl_cert_file", "ssl_key_file")
    @classmethod
    def _readable(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError("file not found")  # the path itself may be revealing; not echoed
        return value

    @field_validator("options")
    @classmethod
    def _not_owned(cls, value: dict[str, Any]) -> dict[str, Any]:
        owned = sorted(k for k in value if k in _OWNED_OPTIONS or k.startswith(_OWNED_PREFIXES))
        if owned:
            raise ValueError(f"{', '.join(owned)} must be set by its own setting")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> KafkaSettings:
        oauth = self.sasl_mechanism == "OAUTHBEARER"
        if self.uses_sasl and oauth and not self.sasl_oauth_token_provider:
            raise ValueError(
                "sasl_mechanism OAUTHBEARER needs sasl_oauth_token_provider "
                "(OUTBOX_KAFKA__SASL_OAUTH_TOKEN_PROVIDER=MODULE:ATTR)"
            )
        if self.uses_sasl and not oauth and (not self.sasl_username or self.sasl_password is None):
            raise ValueError(
                f"security_protocol {self.security_protocol} needs sasl_username and "
                "sasl_password (OUTBOX_KAFKA__SASL_USERNAME, OUTBOX_KAFKA__SASL_PASSWORD)"
            )
        module, _, attribute = (self.sasl_oauth_token_provider or "").partition(":")
        if self.sasl_oauth_token_provider is not None and (
            not oauth or not module or not attribute
        ):
            raise ValueError(
                "sasl_oauth_token_provider is MODULE:ATTR, used with sasl_mechanism OAUTHBEARER"
            )
        if (self.ssl_cert_file is None) != (self.ssl_key_file is None):
            raise ValueError("ssl_cert_file and ssl_key_file go together")
        return self

    def __hash__(self) -> int:
        # Settings are hashable (frozen); the free-form options are a dict, so hash the
        # JSON form (secrets show masked there, which only makes hashes collide more).
        return hash(self.model_dump_json())

    @property
    def uses_tls(self) -> bool:
        return self.security_protocol in ("SSL", "SASL_SSL")

    @property
    def uses_sasl(self) -> bool:
        return self.security_protocol.startswith("SASL_")
