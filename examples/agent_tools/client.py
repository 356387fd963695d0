"""The provider's client (stdlib ``urllib``): errors are left as urllib raises them, so the
effect ledger's default classification sees what a real client would — ``HTTPError``
with a status, a refused connection, a timeout or a reset."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote


class ProviderClient:
    def __init__(self, url: str, timeout: float = 1.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"content-type": "application/json", **(headers or {})},
        )
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            return json.loads(response.read())

    def refund(self, charge: str, amount: int, idempotency_key: str | None = None) -> Any:
        """Make a refund; the provider returns the first refund again for a known key."""
        headers = {"idempotency-key": idempotency_key} if idempotency_key else {}
        return self._request("POST", "/refunds", {"charge": charge, "amount": amount}, headers)

    def find_refund(self, idempotency_key: str) -> Any | None:
        """The refund made with this key, or None (reconciliation)."""
        try:
            return self._request("GET", f"/refunds?idempotency_key={quote(idempotency_key)}")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    def stats(self) -> Any:
        return self._request("GET", "/_stats")
