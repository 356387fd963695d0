"""Idempotent routes for Starlette / FastAPI (optional extra: ``pip install outbox-inbox[asgi]``).

::

    app = Starlette(
        routes=[Route("/refunds", create_refund, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                engine=engine,
                settings=settings,
                routes=[("POST", "/refunds")],
                principal=lambda request: request.headers.get("x-tenant-id"),
            )
        ],
    )

    async def create_refund(request: Request) -> Response:
        session = idempotency_session(request)      # its transaction holds the key
        session.add(Refund(...))
        await outbox.publish_async(session, topic="refunds", ...)
        return JSONResponse({...}, status_code=201)  # do not commit: the middleware does

On the chosen routes the middleware requires an ``Idempotency-Key`` header, claims the key
(see :mod:`outbox.idempotency`), runs the endpoint with a session whose transaction also
holds the key's record, and commits the endpoint's rows, its outbox rows and the stored
response together — *before* the client sees the response, so a 201 always means
committed. A repeated request gets the stored response byte for byte with
``Idempotency-Status: replayed``; errors are JSON ``{"error": {"code", "message"}}``:
400 ``idempotency.key_required`` / ``idempotency.invalid_key``, 422
``idempotency.payload_mismatch``, 409 ``idempotency.in_progress`` (with ``Retry-After``).

The request hash covers the query string and the body (canonical JSON when the body is
JSON, so key order and ``1.0`` vs ``1`` do not matter); ``ignore_fields`` names volatile
body fields (dotted paths) left out of it. Keys are scoped to the principal and the route.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qsl

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from starlette.requests import Request
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from outbox.canonical import sha256_hex
from outbox.errors import OutboxError, PayloadError
from outbox.idempotency.errors import IdempotencyError, IdempotencyInProgress
from outbox.idempotency.keys import (
    IdempotencyKeys,
    StoredResponse,
    failure_response,
    scope_for,
    strip_fields,
    validate_key,
)
from outbox.settings import OutboxSettings

log = logging.getLogger("outbox.idempotency.asgi")

KEY_HEADER = "idempotency-key"
STATUS_HEADER = "idempotency-status"
_SESSION = "outbox_idempotency_session"

Principal = Callable[[Request], str | Awaitable[str | None] | None]


class NoIdempotencySession(OutboxError):
    """``idempotency_session`` was called for a route the middleware does not cover."""


def idempotency_session(request: Request) -> AsyncSession:
    """The session of an idempotent request: add rows and ``publish_async`` to it, never
    commit it (the middleware commits it together with the stored response)."""
    session = request.scope.get("state", {}).get(_SESSION)
    if not isinstance(session, AsyncSession):
        raise NoIdempotencySession(
            f"{request.method} {request.url.path} is not an idempotent route: list it in "
            "IdempotencyMiddleware(routes=...)"
        )
    return session


@dataclass(frozen=True)
class _Route:
    method: str
    template: str
    pattern: re.Pattern[str]


def _error(
    status: int, code: str, message: str, headers: Iterable[tuple[str, str]] = ()
) -> StoredResponse:
    return StoredResponse.json(status, {"error": {"code": code, "message": message}}, headers)


async def _send(send: Send, response: StoredResponse, status_header: str | None = None) -> None:
    headers = [(n.lower().encode("latin-1"), v.encode("latin-1")) for n, v in response.headers]
    if status_header is not None:
        headers.append((STATUS_HEADER.encode(), status_header.encode()))
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": response.body})


@dataclass
class _Capture:
    """Buffers what the endpoint sends, so nothing reaches the client before the commit."""

    status: int = 500
    headers: list[tuple[str, str]] = field(default_factory=list)
    chunks: list[bytes] = field(default_factory=list)

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
            self.headers = [
                (bytes(n).decode("latin-1"), bytes(v).decode("latin-1"))
                for n, v in message.get("headers", [])
            ]
        elif message["type"] == "http.response.body":
            self.chunks.append(bytes(message.get("body", b"")))

    def response(self) -> StoredResponse:
        return StoredResponse(self.status, b"".join(self.chunks), tuple(self.headers))


class BodyTooLarge(Exception):
    pass


class IdempotencyMiddleware:
    """ASGI middleware making the listed ``(METHOD, path template)`` routes idempotent."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        engine: AsyncEngine,
        settings: OutboxSettings,
        routes: Iterable[tuple[str, str]],
        principal: Principal,
        ignore_fields: Iterable[str] = (),
        ttl: timedelta | None = None,
        lock_timeout: timedelta | None = None,
        max_body_bytes: int | None = None,
        session_factory: Callable[[], AsyncSession] | None = None,
        failure: Callable[[Exception], StoredResponse] = failure_response,
    ) -> None:
        self.app = app
        self.engine = engine
        self.keys = IdempotencyKeys(settings, failure)
        self.routes = [
            _Route(method.upper(), path, compile_path(path)[0]) for method, path in routes
        ]
        self.principal = principal
        self.ignore_fields = tuple(ignore_fields)
        self.ttl = ttl
        self.lock_timeout = lock_timeout
        self.max_body_bytes = max_body_bytes or settings.max_payload_bytes
        self.session_factory = session_factory

    def _route(self, scope: Scope) -> _Route | None:
        for route in self.routes:
            if scope["method"] == route.method and route.pattern.match(scope["path"]):
                return route
        return None

    async def _body(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = bytes(message.get("body", b""))
            size += len(chunk)
            if size > self.max_body_bytes:
                raise BodyTooLarge()
            chunks.append(chunk)
            more = bool(message.get("more_body", False))
        return b"".join(chunks)

    def _hash(self, scope: Scope, body: bytes) -> str:
        query = sorted(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        try:
            content: Any = strip_fields(json.loads(body), self.ignore_fields) if body else None
            return sha256_hex([query, content])
        except (ValueError, PayloadError):
            # Not JSON, or JSON without a canonical form (NaN, an integer beyond 2**53):
            # the exact bytes then identify the request.
            return sha256_hex([query, ["raw-sha256", hashlib.sha256(body).hexdigest()]])

    async def _principal(self, request: Request) -> str | None:
        who = self.principal(request)
        return await who if inspect.isawaitable(who) else who

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self._route(scope) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        response, status_header = await self._handle(scope, receive, route)
        await _send(send, response, status_header)

    async def _handle(
        self, scope: Scope, receive: Receive, route: _Route
    ) -> tuple[StoredResponse, str | None]:
        request = Request(scope, receive)
        try:
            key = validate_key(request.headers.get(KEY_HEADER))
            principal = await self._principal(request)
            if principal is None:
                return _error(401, "auth.required", "no principal for this request"), None
            body = await self._body(receive)
        except IdempotencyError as exc:
            return _error(exc.http_status, exc.code, str(exc)), None
        except BodyTooLarge:
            return _error(413, "request.too_large", "request body too large"), None

        async def replay_body() -> Message:
            return {"type": "http.request", "body": body, "more_body": False}

        async def operation(session: AsyncSession) -> StoredResponse:
            capture = _Capture()
            child = {**scope, "state": {**scope.get("state", {}), _SESSION: session}}
            await self.app(child, replay_body, capture.send)
            return capture.response()

        try:
            outcome = await self.keys.run_async(
                self.engine,
                scope=scope_for(principal, f"{route.method} {route.template}"),
                key=key,
                payload_hash=self._hash(scope, body),
                operation=operation,
                ttl=self.ttl,
                lock_timeout=self.lock_timeout,
                session_factory=self.session_factory,
            )
        except IdempotencyInProgress as exc:
            retry_after = [("retry-after", str(exc.retry_after))]
            return _error(exc.http_status, exc.code, str(exc), retry_after), None
        except IdempotencyError as exc:
            return _error(exc.http_status, exc.code, str(exc)), None
        except Exception as exc:
            stored = self.keys.failure_for(exc)
            if stored is not None:
                # The same response the key now replays, so the first answer matches.
                log.exception("idempotent request failed permanently; failure stored")
                return stored, "stored"
            log.exception("idempotent request failed transiently; key released")
            return _error(
                503,
                "unavailable",
                "temporary failure; retry with the same key",
                [("retry-after", "1")],
            ), None
        if outcome.replayed:
            return outcome.response, "replayed"
        return outcome.response, "stored" if outcome.stored else None
