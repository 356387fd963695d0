"""Kafka SASL/OAUTHBEARER: the deployment's token provider, and two fixes to aiokafka's use
of it.

The provider is the deployment's own code (MSK IAM's signer, an OIDC client-credentials
grant), named by ``OUTBOX_KAFKA__SASL_OAUTH_TOKEN_PROVIDER=MODULE:ATTR`` and made once per
process. It is made outside any event loop and shared by every client: a provider that
needs loop-bound resources (an HTTP session) should create them inside ``token()``.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import aiokafka.conn
from aiokafka.abc import AbstractTokenProvider
from aiokafka.errors import KafkaConnectionError, KafkaError

from outbox.errors import ConfigurationError
from outbox.imports import import_target

SETTING = "OUTBOX_KAFKA__SASL_OAUTH_TOKEN_PROVIDER"


class TokenUnavailable(KafkaConnectionError):  # type: ignore[misc]
    """The token provider failed (its identity provider down, say). To aiokafka it is a
    connection error, so its clients retry the connection; any other exception would end
    the background task that asked (metadata refresh, the producer's sender) for good."""


class _GuardedTokens(AbstractTokenProvider):  # type: ignore[misc]
    def __init__(self, provider: AbstractTokenProvider, target: str) -> None:
        self.provider, self._target = provider, target

    async def token(self) -> str:
        try:
            token: str = await self.provider.token()
        except (KafkaError, OSError, TimeoutError):
            raise
        except Exception as exc:
            raise TokenUnavailable(
                f"OAUTHBEARER token provider {self._target} failed: "
                f"{type(exc).__name__}: {str(exc)[:200]}"
            ) from exc
        return token

    def extensions(self) -> dict[str, str]:
        extensions: dict[str, str] = self.provider.extensions()
        return extensions


def _error_challenge(payload: bytes) -> bool:
    try:
        parsed = json.loads(payload)
    except ValueError:
        return False
    return isinstance(parsed, dict) and "status" in parsed


class _OAuthExchange(aiokafka.conn.OAuthAuthenticator):  # type: ignore[misc]
    """aiokafka's OAUTHBEARER exchange, finished as RFC 7628 (3.2.3) says. A broker that
    rejects the token answers with an error challenge ({"status": "invalid_token"}) and
    fails the authentication only after the client replies %x01. aiokafka (0.14) stops
    after sending the token, so a rejected token looked like a success followed by a broker
    that never answered: clients retried metadata forever instead of failing with
    SaslAuthenticationFailed. Only the public constructor and ``step`` are relied on."""

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


@functools.cache
def token_provider(target: str) -> AbstractTokenProvider:
    """The token provider ``MODULE:ATTR`` names (an instance, or a class or function
    returning one), made once per process and guarded (see :class:`TokenUnavailable`)."""
    aiokafka.conn.OAuthAuthenticator = _OAuthExchange  # what every connection's exchange uses
    try:
        found = import_target(target)
    except ValueError as exc:
        raise ConfigurationError(f"{SETTING}: {exc}") from None
    if callable(found) and not isinstance(found, AbstractTokenProvider):
        try:
            found = found()
        except Exception as exc:
            raise ConfigurationError(
                f"{SETTING}: {target}() failed: {type(exc).__name__}: {str(exc)[:200]}"
            ) from None
    if not isinstance(found, AbstractTokenProvider):
        raise ConfigurationError(
            f"{SETTING}: {target} is not an aiokafka.abc.AbstractTokenProvider "
            f"(got {type(found).__name__})"
        )
    return _GuardedTokens(found, target)
