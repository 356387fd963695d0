"""What every console request shares: the :class:`Console` (settings, stores, engines, the
guard, the templates) and the form reader."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import parse_qs, urlencode

from jinja2 import Environment, PackageLoader
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse

from outbox.console.filters import BadFilter
from outbox.console.metrics import ConsoleMetrics
from outbox.console.ports import Backends
from outbox.console.sampler import Sampler
from outbox.console.security import Guard
from outbox.db import async_engine, sync_engine
from outbox.effects import Effects
from outbox.settings import OutboxSettings

Form = dict[str, list[str]]
# scheme://anything: a database or broker URL in a message may carry a password.
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://\S+")


def query_string(params: Mapping[str, str], **overrides: object) -> str:
    """``params`` with ``overrides`` as a query string (for links that keep the filters)."""
    merged = {**params, **{k: str(v) for k, v in overrides.items() if v is not None}}
    return urlencode(merged)


def scrub(text: object) -> str:
    """Text for a page with every URL blanked (messages from drivers and doctor checks)."""
    return _URL.sub("<url>", str(text))


_MAX_FORM_BYTES = 1_048_576


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
        self.aengine: AsyncEngine = async_engine(settings)
        self.sengine: Engine = sync_engine(settings, pool_size=2, max_overflow=2)
        # Autoescape everywhere: every value on a page may come from a payload or an error.
        self.templates = Environment(
            loader=PackageLoader("outbox.console", "templates"), autoescape=True
        )
        self.templates.globals["qs"] = query_string
        self.templates.filters["scrub"] = scrub

    def render(
        self, request: Request, name: str, status: int = 200, **context: Any
    ) -> HTMLResponse:
        page = self.templates.get_template(name).render(
            request=request,
            csrf=self.guard.csrf,
            allow_actions=self.allow_actions,
            login_required=self.guard.required,
            **context,
        )
        return HTMLResponse(page, status_code=status)

    def error(self, request: Request, status: int, message: str) -> HTMLResponse:
        return self.render(request, "error.html", status, status_code=status, message=message)

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
    return parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)


def first(form: Form, name: str) -> str | None:
    values = form.get(name)
    return values[0] if values else None
