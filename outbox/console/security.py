"""The console's safety rules: where it may listen, who may read it, what a POST must carry,
the response headers, and the audit trail of every action.

* Bound to loopback it needs no token (whoever can reach it is on the machine); bound to
  anything else it refuses to start without ``console.token``. Without a token it answers
  loopback ``Host`` headers only (a DNS-rebinding page cannot read it as same-origin).
  A token that is set must have at least :data:`MIN_TOKEN_CHARS` characters, wherever it
  listens: an empty one (a secret with a missing key) would otherwise open the door.
* With a token, every page needs it: ``Authorization: Bearer <token>``, or a session the
  login form opens. A session is a random id (the cookie) naming a record kept in this
  process (:class:`Sessions`): it expires after ``console.session_hours``, logging out
  deletes it, and a restart — which is how a changed token takes effect — forgets every
  session. Token comparisons use :func:`hmac.compare_digest`; sessions are looked up by
  the SHA-256 of their id, so lookups reveal nothing of an id through timing.
* Actions are POSTs carrying the session's CSRF token (a random value rendered in the
  console's own forms; another site's page cannot read it), and only with
  ``--allow-actions``. Without a token the browser still gets a session (opened with its
  first page), for its CSRF token. The session cookie is ``SameSite=Strict`` as a second
  line, ``HttpOnly``, and ``Secure`` over HTTPS.
* Every response carries a Content-Security-Policy that allows the console's own files only
  (no inline script, no inline style; the refresh script fetches from the console itself),
  ``nosniff``, ``no-referrer`` and ``no-store``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from outbox.console.metrics import ConsoleMetrics
from outbox.errors import ConfigurationError
from outbox.settings import OutboxSettings

LOOPBACK_NAMES = {"localhost"}
# Host headers a console without a token answers (the port is not part of the match).
LOOPBACK_HOSTS = ["127.0.0.1", "localhost", "[::1]", "::1"]
SESSION_COOKIE = "outbox_console"
MIN_TOKEN_CHARS = 16
# Sessions kept at most; the oldest goes first (a login loop cannot grow the process).
MAX_SESSIONS = 10_000
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
    (b"x-frame-options", b"DENY"),
]
_NEW_TOKEN = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"

audit_log = logging.getLogger("outbox.console.audit")


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_token(settings: OutboxSettings) -> None:
    """Refuse a token that is set but empty or short (whatever the console binds)."""
    token = settings.console.token
    if token is None:
        return
    size = len(token.get_secret_value())
    if not token.get_secret_value().strip():
        raise ConfigurationError(
            "OUTBOX_CONSOLE__TOKEN is set but empty: set at least "
            f"{MIN_TOKEN_CHARS} characters (e.g. {_NEW_TOKEN}), or unset it to serve "
            "127.0.0.1 only"
        )
    if size < MIN_TOKEN_CHARS:
        raise ConfigurationError(
            f"OUTBOX_CONSOLE__TOKEN has {size} characters, fewer than {MIN_TOKEN_CHARS}: "
            f"use a longer one (e.g. {_NEW_TOKEN})"
        )


def check_bind(host: str, settings: OutboxSettings) -> None:
    """Refuse a short token, and to listen beyond this machine without a token."""
    check_token(settings)
    if not is_loopback(host) and settings.console.token is None:
        raise ConfigurationError(
            f"refusing to bind {host} without a token: set OUTBOX_CONSOLE__TOKEN "
            "(or bind 127.0.0.1)"
        )


@dataclass
class Session:
    """One browser's session: its CSRF token, until when it holds, and who opened it."""

    csrf: str
    expires: float  # time.monotonic()
    who: str


class Sessions:
    """The sessions of this process, by the SHA-256 of their id (the cookie's value)."""

    def __init__(self, ttl_seconds: float, limit: int = MAX_SESSIONS) -> None:
        self.ttl_seconds = ttl_seconds
        self._limit = limit
        self._by_digest: OrderedDict[bytes, Session] = OrderedDict()

    @staticmethod
    def _digest(session_id: str) -> bytes:
        return hashlib.sha256(session_id.encode("utf-8", "replace")).digest()

    def open(self, who: str) -> tuple[str, Session]:
        """A new session: (its id, for the cookie, and the session)."""
        self._expire()
        while len(self._by_digest) >= self._limit:
            self._by_digest.popitem(last=False)
        session_id = secrets.token_urlsafe(32)
        session = Session(secrets.token_urlsafe(32), time.monotonic() + self.ttl_seconds, who)
        self._by_digest[self._digest(session_id)] = session
        return session_id, session

    def get(self, session_id: str | None) -> Session | None:
        if not session_id:
            return None
        digest = self._digest(session_id)
        session = self._by_digest.get(digest)
        if session is not None and session.expires <= time.monotonic():
            del self._by_digest[digest]
            return None
        return session

    def close(self, session_id: str | None) -> None:
        if session_id:
            self._by_digest.pop(self._digest(session_id), None)

    def _expire(self) -> None:
        now = time.monotonic()
        for digest in [d for d, s in self._by_digest.items() if s.expires <= now]:
            del self._by_digest[digest]

    def __len__(self) -> int:
        return len(self._by_digest)


class Guard:
    """Authentication, sessions and CSRF checks of one console process."""

    def __init__(self, settings: OutboxSettings, metrics: ConsoleMetrics) -> None:
        check_token(settings)
        self.metrics = metrics
        token = settings.console.token
        self._token = token.get_secret_value().encode() if token is not None else None
        self.who = settings.console.token_name if token is not None else "local"
        self.sessions = Sessions(settings.console.session_hours * 3600)

    @property
    def required(self) -> bool:
        return self._token is not None

    def token_matches(self, given: str) -> bool:
        return self._token is not None and hmac.compare_digest(
            given.encode("utf-8", "replace"), self._token
        )

    def session(self, request: Request) -> Session | None:
        """The request's live session, if its cookie names one."""
        return self.sessions.get(request.cookies.get(SESSION_COOKIE))

    def allows(self, request: Request) -> bool:
        if self._token is None:
            return True
        header = request.headers.get("authorization", "")
        if header.lower().startswith("bearer ") and self.token_matches(header[7:].strip()):
            return True
        return self.session(request) is not None

    def csrf_ok(self, session: Session | None, given: str | None) -> bool:
        return (
            session is not None
            and given is not None
            and hmac.compare_digest(given.encode("utf-8", "replace"), session.csrf.encode())
        )

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
