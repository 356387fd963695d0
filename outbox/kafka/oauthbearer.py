"""Kafka SASL/OAUTHBEARER: the deployment's token provider, and two fixes to aiokafka's use
of it (a failing provider is a connection error here; the exchange itself is finished in
:mod:`outbox.kafka.aiokafka_internals`).

The provider is the deployment's own code (MSK IAM's signer, an OIDC client-credentials
grant), named by ``OUTBOX_KAFKA__SASL_OAUTH_TOKEN_PROVIDER=MODULE:ATTR`` and made once per
process. It is made outside any event loop and shared by every client: a provider that
needs loop-bound resources (an HTTP session) should create them inside ``token()``.
"""

from __future__ import annotations

import functools

from aiokafka.abc import AbstractTokenProvider
from aiokafka.errors import KafkaConnectionError, KafkaError

from outbox.errors import ConfigurationError
from outbox.imports import import_target
from outbox.kafka.aiokafka_internals import install_oauth_exchange

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


@functools.cache
def token_provider(target: str) -> AbstractTokenProvider:
    """The token provider ``MODULE:ATTR`` names (an instance, or a class or function
    returning one), made once per process and guarded (see :class:`TokenUnavailable`)."""
    install_oauth_exchange()  # what every connection's exchange uses (aiokafka_internals)
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
