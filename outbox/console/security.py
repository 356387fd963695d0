"""The console's safety rules: where it may listen, who may read it, what a POST must carry,
the response headers, and the audit trail of every action.

* Bound to loopback it needs no token (whoever can reach it is on the machine); bound to
  anything else it refuses to start without ``console.token``. Without a token it answers
  loopback ``Host`` headers only (a DNS-rebinding page cannot read it as same-origin).
* With a token, every page needs it: ``Authorization: Bearer <token>``, or the session
  cookie the login form sets (an HMAC of the token, so the cookie is not the token itself).
  Comparisons use :func:`hmac.compare_digest`.
* Actions are POSTs carrying the process's CSRF token (a random value rendered in the
  console's own forms; another site's page cannot read it), and only with
  ``--allow-actions``. The session cookie is ``SameSite=Strict`` as a second line.
* Every response carries a Content-Security-Policy that allows the console's own files only
  (no inline script, no inline style), ``nosniff``, ``no-referrer`` and ``no-store``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import secrets

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from outbox.console.metrics import ConsoleMetrics
from outbox.errors import ConfigurationError
from outbox.settings import OutboxSettings

LOOPBACK_NAMES = {"localhost"}
# Host headers a console without a token answers (the port is not part of the match).
LOOPBACK_HOSTS = ["127.0.0.1", "localhost", "[::1]", "::1"]
SESSION_COOKIE = "outbox_console"
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
    (b"x-frame-options", b"DENY"),
]

audit_log = logging.getLogger("outbox.console.audit")


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, settings: OutboxSettings) -> None:
    """Refuse to listen beyond this machine without a token."""
    if not is_loopback(host) and settings.console.token is None:
        raise ConfigurationError(
            f"refusing to bind {host} without a token: set OUTBOX_CONSOLE__TOKEN "
            "(or bind 127.0.0.1)"
        )


class Guard:
    """Authentication and CSRF checks of one console process."""

    def __init__(self, settings: OutboxSettings, metrics: ConsoleMetrics) -> None:
        self.metrics = metrics
        token = settings.console.token
        self._token = token.get_secret_value().encode() if token is not None else None
        self.who = settings.console.token_name if token is not None else "local"
        self.csrf = secrets.token_urlsafe(32)

    @property
    def required(self) -> bool:
        return self._token is not None

    def session_value(self) -> str:
        assert self._token is not None
        return hmac.new(self._token, b"outbox-console-session", hashlib.sha256).hexdigest()

    def token_matches(self, given: str) -> bool:
        return self._token is not None and hmac.compare_digest(given.encode(), self._token)

    def allows(self, request: Request) -> bool:
        if self._token is None:
            return True
        header = request.headers.get("authorization", "")
        if header.lower().startswith("bearer ") and self.token_matches(header[7:].strip()):
            return True
        cookie = request.cookies.get(SESSION_COOKIE, "")
        return bool(cookie) and hmac.compare_digest(cookie, self.session_value())

    def csrf_ok(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), self.csrf.encode())

    def audit(self, action: str, items: int, what: str) -> None:
        """One line per action: who (the token's name), what, how many."""
        self.metrics.actions.labels(action).inc()
        self.metrics.items.labels(action).inc(items)
        audit_log.warning(
            "console action by=%s action=%s items=%d %s", self.who, action, items, what
        )


class SecurityHeaders:
    """Adds :data:`HEADERS` to every response (pages, static files, errors)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], *HEADERS]
            await send(message)

        await self.app(scope, receive, with_headers)
