"""What every console request shares: the :class:`Console` (settings, stores, engines, the
guard, the templates) and the form reader."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import parse_qs, urlencode

from jinja2 import Environment, PackageLoader
from markupsafe import Markup
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse

from outbox.console.filters import BadFilter, check_params
from outbox.console.metrics import ConsoleMetrics
from outbox.console.ports import Backends
from outbox.console.sampler import Sampler
from outbox.console.security import Guard
from outbox.db import async_engine, sync_engine, translated_errors
from outbox.effects import Effects
from outbox.errors import OutboxError
from outbox.ops.store import OpsStore
from outbox.ops.wal_health import mib
from outbox.scrub import scrub
from outbox.settings import OutboxSettings
from outbox.tables import build_tables

Form = dict[str, list[str]]


def query_string(params: Mapping[str, str], **overrides: object) -> str:
    """``params`` with ``overrides`` as a query string (for links that keep the filters)."""
    merged = {**params, **{k: str(v) for k, v in overrides.items() if v is not None}}
    return urlencode(merged)


class Verbatim(str):
    """A value a page shows as it is (escaped, not scrubbed): a payload the settings let an
    operator see. Nothing else is wrapped in it."""


def shown(value: Any) -> Any:
    """Jinja's ``finalize``: every ``{{ value }}`` of every template passes here before it
    is escaped, so no page can forget to scrub (:func:`outbox.scrub.scrub`) what came from
    a payload, an error, a driver or a doctor finding."""
    if value is None or isinstance(value, bool | int | float | Verbatim):
        return value
    if isinstance(value, Markup):  # a macro's output: its own values were scrubbed
        return Markup(scrub(value))
    return scrub(value)


_MAX_FORM_BYTES = 1_048_576
HEALTH_TIMEOUT_SECONDS = 3.0


class Console:
    """Everything a request needs: settings, stores, engines, the guard, the templates."""

    def __init__(self, settings: OutboxSettings, backends: Backends, allow_actions: bool) -> None:
        self.settings = settings
        self.backends = backends
        self.allow_actions = allow_actions
        self.metrics = ConsoleMetrics(CollectorRegistry())
        self.guard = Guard(settings, self.metrics)
        self.sampler = Sampler()
        self.effects = Effects(settings)
        self.ops = OpsStore(build_tables(settings))
        self.aengine: AsyncEngine = async_engine(settings)
        self.sengine: Engine = sync_engine(settings, pool_size=2, max_overflow=2)
        # Autoescape everywhere: every value on a page may come from a payload or an error;
        # and every value is scrubbed first (shown).
        self.templates = Environment(
            loader=PackageLoader("outbox.console", "templates"), autoescape=True, finalize=shown
        )
        self.templates.globals["qs"] = query_string
        self.templates.globals["mib"] = mib

    def render(
        self, request: Request, name: str, status: int = 200, **context: Any
    ) -> HTMLResponse:
        session = getattr(request.state, "session", None)
        page = self.templates.get_template(name).render(
            request=request,
            csrf=session.csrf if session is not None else "",
            allow_actions=self.allow_actions,
            login_required=self.guard.required,
            # The refresh script asks for the page's main part only (static/console.js).
            fragment=request.query_params.get("fragment") == "1",
            refresh_seconds=self.settings.console.refresh_seconds,
            now=dt.datetime.now(dt.UTC),
            **context,
        )
        return HTMLResponse(page, status_code=status)

    def error(self, request: Request, status: int, message: str) -> HTMLResponse:
        return self.render(request, "error.html", status, status_code=status, message=message)

    async def database_problem(self) -> str | None:
        """None while the database answers a query within :data:`HEALTH_TIMEOUT_SECONDS`;
        else what went wrong, in one line (for ``/healthz``)."""
        try:
            with translated_errors():
                async with asyncio.timeout(HEALTH_TIMEOUT_SECONDS):
                    async with self.aengine.connect() as conn:
                        await conn.execute(self.ops.db_now())
        except TimeoutError:
            return f"the database did not answer within {HEALTH_TIMEOUT_SECONDS:g} s"
        except (OutboxError, DBAPIError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}".splitlines()[0]
        return None

    async def sync(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A blocking store call (the effects ledger, the failed table) off the loop."""
        return await run_in_threadpool(fn, *args, **kwargs)

    async def close(self) -> None:
        await self.backends.dead_letters.close()
        await self.aengine.dispose()
        self.sengine.dispose()


def console_of(request: Request) -> Console:
    console: Console = request.app.state.console
    return console


async def read_form(request: Request) -> Form:
    """An ``application/x-www-form-urlencoded`` body (the console's forms send nothing
    else; no multipart parser needed)."""
    body = await request.body()
    if len(body) > _MAX_FORM_BYTES:
        raise BadFilter("form too large")
    form = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    check_params((k, v) for k, values in form.items() for v in values)
    return form


def first(form: Form, name: str) -> str | None:
    values = form.get(name)
    return values[0] if values else None
