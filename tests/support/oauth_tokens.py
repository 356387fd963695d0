"""OAUTHBEARER token providers for the test broker, named in settings as MODULE:ATTR.

The test services' SASL_SSL listener validates OAUTHBEARER tokens with Kafka's default
validator, which takes unsigned JWTs (``alg: none``) and checks their subject and expiry.
A real deployment's provider fetches signed tokens (an OIDC client-credentials grant, or
MSK IAM's signer) and refreshes them before they expire.
"""

from __future__ import annotations

import base64
import json
import time

from aiokafka.abc import AbstractTokenProvider


def _b64(part: dict[str, object]) -> str:
    return base64.urlsafe_b64encode(json.dumps(part).encode()).rstrip(b"=").decode()


class UnsignedToken(AbstractTokenProvider):
    def __init__(self, subject: str = "outbox-tests", lifetime_seconds: float = 3600) -> None:
        self.subject, self.lifetime = subject, lifetime_seconds

    async def token(self) -> str:
        now = time.time()
        claims = {"sub": self.subject, "iat": now - 1, "exp": now + self.lifetime}
        return f"{_b64({'alg': 'none'})}.{_b64(claims)}."


valid = UnsignedToken()  # an instance


class Expired(UnsignedToken):  # a class (made once per process)
    def __init__(self) -> None:
        super().__init__(lifetime_seconds=-300)


not_a_provider = object()
