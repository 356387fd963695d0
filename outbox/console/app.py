"""The console's Starlette application: the guards every route goes through and the route
table. What requests share is in ``state.py``, the pages in ``pages.py``, the actions in
``actions.py``; none holds SQL: they call the same functions the CLI calls."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from outbox.console import actions, pages
from outbox.console.filters import BadFilter, check_params
from outbox.console.ports import Backends
from outbox.console.security import LOOPBACK_HOSTS, SESSION_COOKIE, SecurityHeaders
from outbox.console.state import Console, Form, console_of, first, read_form
from outbox.errors import NotFound, OutboxError
from outbox.scrub import scrub
from outbox.settings import OutboxSettings

log = logging.getLogger(__name__)
Handler = Callable[["Console", Request], Awaitable[Response]]
ActionHandler = Callable[["Console", Request, Form], Awaitable[Response]]


def _failure(console: Console, request: Request, exc: Exception) -> Response:
    if isinstance(exc, BadFilter):
        return console.error(request, 400, str(exc))
    if isinstance(exc, NotFound):
        return console.error(request, 404, str(exc))
    # A framework error says what failed in one line, without DSNs or SQL (errors.py).
    log.warning("console request failed: %s: %s", type(exc).__name__, exc)
    retriable = isinstance(exc, OutboxError) and exc.retriable  # e.g. the database is down
    return console.error(request, 503 if retriable else 409, str(exc))


def _set_session_cookie(request: Request, response: Response, session_id: str) -> None:
    console = console_of(request)
    response.set_cookie(
        SESSION_COOKIE,
        session_id,
        max_age=int(console.guard.sessions.ttl_seconds),
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def page(fn: Handler) -> Callable[[Request], Awaitable[Response]]:
    """A GET page: authenticated (or sent to the login form), errors as pages. Without a
    token, a browser's first page opens its session (for the CSRF token of its forms)."""

    async def handler(request: Request) -> Response:
        console = console_of(request)
        guard = console.guard
        if not guard.allows(request):
            return RedirectResponse("/login", status_code=303)
        request.state.session = session = guard.session(request)
        opened = None
        if session is None and not guard.required:
            opened, request.state.session = guard.sessions.open(guard.who)
        try:
            check_params(request.query_params.multi_items())
            response = await fn(console, request)
        except (BadFilter, OutboxError) as exc:
            response = _failure(console, request, exc)
        if opened is not None:
            _set_session_cookie(request, response, opened)
        return response

    return handler


def action(fn: ActionHandler) -> Callable[[Request], Awaitable[Response]]:
    """A POST: authenticated, refused in read-only mode, refused without the session's
    CSRF token."""

    async def handler(request: Request) -> Response:
        console = console_of(request)
        if not console.guard.allows(request):
            return console.error(request, 401, "log in first")
        if not console.allow_actions:
            return console.error(request, 403, "read-only console: start it with --allow-actions")
        request.state.session = session = console.guard.session(request)
        try:
            form = await read_form(request)
            if not console.guard.csrf_ok(session, first(form, "csrf")):
                return console.error(request, 403, "missing or wrong CSRF token: reload the page")
            return await fn(console, request, form)
        except (BadFilter, OutboxError) as exc:
            return _failure(console, request, exc)

    return handler


async def healthz(request: Request) -> Response:
    """200 while the database answers a query; 503 (with the reason) when it does not."""
    problem = await console_of(request).database_problem()
    if problem is not None:
        return PlainTextResponse(f"unhealthy: {scrub(problem)}", status_code=503)
    return PlainTextResponse("ok")


async def metrics(request: Request) -> Response:
    registry = console_of(request).metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


async def login(request: Request) -> Response:
    console = console_of(request)
    if request.method == "GET":
        return console.render(request, "login.html")
    try:
        token = first(await read_form(request), "token") or ""
    except BadFilter as exc:
        return console.error(request, 400, str(exc))
    if not console.guard.token_matches(token):
        return console.render(request, "login.html", 401, failed=True)
    console.guard.sessions.close(request.cookies.get(SESSION_COOKIE))
    session_id, _ = console.guard.sessions.open(console.guard.who)
    response = RedirectResponse("/", status_code=303)
    _set_session_cookie(request, response, session_id)
    return response


async def logout(request: Request) -> Response:
    """End the session (a POST with its CSRF token: a link elsewhere cannot log you out)."""
    console = console_of(request)
    session = console.guard.session(request)
    try:
        form = await read_form(request)
    except BadFilter as exc:
        return console.error(request, 400, str(exc))
    if not console.guard.csrf_ok(session, first(form, "csrf")):
        return console.error(request, 403, "missing or wrong CSRF token: reload the page")
    console.guard.sessions.close(request.cookies.get(SESSION_COOKIE))
    response = RedirectResponse("/login" if console.guard.required else "/", status_code=303)
    response.delete_cookie(SESSION_COOKIE, httponly=True, samesite="strict")
    return response


def create_app(settings: OutboxSettings, backends: Backends, *, allow_actions: bool) -> Starlette:
    """The console. ``allow_actions=False`` (the default of ``outbox console``) makes it
    read-only: no action buttons, every action POST refused."""
    console = Console(settings, backends, allow_actions)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        every = settings.console.sample_seconds
        task = asyncio.create_task(console.sampler.run(console.aengine, settings, every))
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await console.close()

    routes = [
        Route("/healthz", healthz),
        Route("/metrics", metrics),
        Route("/login", login, methods=["GET", "POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/", page(pages.overview)),
        Route("/consumers", page(pages.consumers_page)),
        Route("/dead-letters", page(pages.dead_letters)),
        Route("/dead-letters/show", page(pages.dead_letter)),
        Route("/dead-letters/action", action(actions.dead_letters), methods=["POST"]),
        Route("/failed", page(pages.failed)),
        Route("/failed/action", action(actions.failed), methods=["POST"]),
        Route("/effects", page(pages.effects)),
        Route("/effects/show", page(pages.effect)),
        Route("/effects/action", action(actions.effects), methods=["POST"]),
        Mount("/static", StaticFiles(directory=Path(__file__).parent / "static"), name="static"),
    ]
    middleware = [Middleware(SecurityHeaders)]
    if not console.guard.required:
        # Without a token the console trusts whoever reaches it, which must then be this
        # machine: a page elsewhere could otherwise point its own name at 127.0.0.1 (DNS
        # rebinding) and read the console as same-origin. Loopback names only.
        middleware.append(Middleware(TrustedHostMiddleware, allowed_hosts=LOOPBACK_HOSTS))
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan)
    app.state.console = console
    return app
