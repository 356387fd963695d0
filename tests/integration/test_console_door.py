"""The console's door, tried as an attacker would: tokens too short to guard anything,
sessions after a token change, a logout and an expiry, query strings no filter can hold —
in a real headless Chromium against the console run as the CLI runs it — and a password
inside stored error text, looked for on every page the console renders."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import Browser
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine, update

from inbox import DeadLetters
from outbox.console import Backends, FailedRows, create_app
from outbox.effects import Ambiguous, EffectOutcomeUnknown, Effects
from outbox.settings import ConsoleSettings, OutboxSettings
from outbox.tables import build_tables
from relay.failed import list_failed, purge_failed, retry_failed
from tests.support.console import (
    chromium_browser,
    console_process,
    seed_dead_letters,
    seed_failed_rows,
)
from tests.support.inbox import ROOT, subprocess_env
from tests.support.tables import engine_of, own_tables

pytestmark = pytest.mark.integration
TOKEN = "first-token-of-the-console-0123"
# What a handler's error may hold: a database URL with its password.
SECRET_URL = "postgresql://svc:pw@db.internal:5432/pay"
PASSWORD_MARKS = ("svc:pw@", "pw@db.internal", ":pw@")
TEMPLATES = {p.name for p in Path(ROOT, "outbox", "console", "templates").glob("*.html")}


@pytest.fixture(scope="module")
def dsettings(base_settings: OutboxSettings) -> OutboxSettings:
    return own_tables(base_settings, "d")


@pytest.fixture(scope="module")
def dengine(dsettings: OutboxSettings) -> Iterator[Engine]:
    with engine_of(dsettings) as e:
        yield e


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    async with chromium_browser() as b:
        yield b


def test_an_empty_or_short_token_refuses_to_start(dsettings: OutboxSettings) -> None:
    started = {
        token: subprocess.Popen(
            [sys.executable, "-m", "cli", "console", "--host", "0.0.0.0", "--allow-actions"],
            env=subprocess_env(dsettings, OUTBOX_CONSOLE__TOKEN=token),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for token in ("", "ten-chars!")
    }
    for token, proc in started.items():
        _, err = proc.communicate(timeout=60)
        lines = err.decode().strip().splitlines()
        assert proc.returncode == 2, err
        assert len(lines) == 1 and "OUTBOX_CONSOLE__TOKEN" in lines[0], lines
        assert ("empty" if not token else "10 characters") in lines[0]
        assert token == "" or token not in lines[0]


async def test_sessions_end_with_the_token_at_logout_and_at_expiry_in_chromium(
    dsettings: OutboxSettings, browser: Browser
) -> None:
    context = await browser.new_context()
    page = await context.new_page()
    with console_process(dsettings, OUTBOX_CONSOLE__TOKEN=TOKEN) as (url, _):
        await page.goto(url + "/failed")
        assert page.url.endswith("/login")
        await page.fill("input[name=token]", "wrong-but-long-enough-token")
        await page.click("button[type=submit]")
        assert "wrong token" in await page.inner_text("main")
        await page.fill("input[name=token]", TOKEN)
        await page.click("button[type=submit]")
        await page.wait_for_url(url + "/")
        [cookie] = await context.cookies()
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        assert TOKEN not in cookie["value"]
        await page.goto(url + "/failed")
        assert page.url.endswith("/failed")
        # Logging out ends the session: the old cookie no longer opens a page.
        await page.click("#logout")
        await page.wait_for_url(url + "/login")
        async with httpx.AsyncClient(cookies={cookie["name"]: cookie["value"]}) as client:
            stale = await client.get(url + "/failed")
        assert stale.status_code == 303 and stale.headers["location"] == "/login"
        await page.fill("input[name=token]", TOKEN)
        await page.click("button[type=submit]")
        await page.wait_for_url(url + "/")
        [old_token_cookie] = await context.cookies()
    # The token changes (a restart with the new one): the old session is refused. The new
    # console's sessions last 0.001 h = 3.6 s: one expires.
    second = "second-token-of-the-console"
    with console_process(
        dsettings, OUTBOX_CONSOLE__TOKEN=second, OUTBOX_CONSOLE__SESSION_HOURS="0.001"
    ) as (url, _):
        assert (await context.cookies())[0]["value"] == old_token_cookie["value"]
        await page.goto(url + "/failed")  # the browser sends the old cookie (same host)
        assert page.url.endswith("/login")
        await page.fill("input[name=token]", second)
        await page.click("button[type=submit]")
        await page.wait_for_url(url + "/")
        await page.goto(url + "/failed")
        assert page.url.endswith("/failed")
        await page.wait_for_timeout(4_000)
        await page.goto(url + "/failed")
        assert page.url.endswith("/login")
    await context.close()


BAD_QUERIES = [
    ("/dead-letters?topic=%00", "NUL"),
    ("/dead-letters?consumer=x&type=a%00b", "NUL"),
    ("/dead-letters?error_class=%00", "NUL"),
    ("/dead-letters?state=%00", "NUL"),
    ("/dead-letters?group=%00", "NUL"),
    ("/dead-letters?page=1000000000000000000", "page"),
    ("/dead-letters?page=" + "9" * 30, "page"),
    ("/dead-letters?after=not-a-date", "after"),
    ("/dead-letters?before=2026-02-30T10:00", "before"),
    ("/dead-letters/show?consumer=c&event_id=a%00b", "NUL"),
    ("/effects?state=unknown%00", "NUL"),
    ("/effects/show?key=a%00b", "NUL"),
    ("/failed?topic=%00", "NUL"),
    ("/?refresh=%00", "NUL"),
]


async def test_bad_query_parameters_are_a_400_in_chromium(
    dsettings: OutboxSettings, browser: Browser
) -> None:
    page = await browser.new_page()
    with console_process(dsettings) as (url, proc):
        for path, says in BAD_QUERIES:
            response = await page.goto(url + path)
            assert response is not None and response.status == 400, path
            message = await page.inner_text("p.error")
            assert says in message and len(message) < 100, (path, message)
        ok = await page.goto(url + "/dead-letters?page=2&after=2026-01-01T00:00")
        assert ok is not None and ok.status == 200
    await page.close()
    assert b"Traceback" not in proc.stderr.read()  # type: ignore[union-attr]


# ------------------------------------------------------------------ no secret on any page


def _poison(settings: OutboxSettings, engine: Engine) -> dict[str, str]:
    """One of everything the console shows, each with ``SECRET_URL`` in its error."""
    consumer = f"leaky-{uuid.uuid4().hex[:6]}"
    [event_id] = seed_dead_letters(
        settings,
        1,
        consumer=consumer,
        error_class="OperationalError",
        message=f"could not connect to {SECRET_URL}: timeout",
        event_type=f"order.placed from {SECRET_URL}",
    )
    tables = build_tables(settings)
    with engine.begin() as conn:
        conn.execute(
            update(tables.dead_letters)
            .where(tables.dead_letters.c.event_id == event_id)
            .values(
                history=[
                    {
                        "at": dt.datetime.now(dt.UTC).isoformat(),
                        "attempt": 1,
                        "replay": 0,
                        "error_class": "OperationalError",
                        "message": f"could not connect to {SECRET_URL}",
                        "frame": "app/db.py:3 in connect",
                        "trace": 'File "app/db.py", line 3, in connect\n'
                        f'    engine = create_engine("{SECRET_URL}")\n',
                        "host": "h",
                        "pid": 1,
                    }
                ]
            )
        )
    seed_failed_rows(
        engine, settings, [700_001], "leaky-topic", f"KafkaError: broker {SECRET_URL} refused"
    )
    effects = Effects(settings, registry=CollectorRegistry())
    key = f"leaky-{uuid.uuid4().hex[:8]}"

    def lost(k: str) -> None:
        raise Ambiguous(f"no answer from {SECRET_URL} after sending")

    with pytest.raises(EffectOutcomeUnknown):
        effects.run(engine, key=key, call=lost, dependency="payments")
    return {"consumer": consumer, "event_id": event_id, "effect": key}


async def test_no_page_shows_a_password_from_stored_text(
    dsettings: OutboxSettings, dengine: Engine
) -> None:
    """Every template is rendered (the test fails when one is not) with data whose errors
    hold ``SECRET_URL``; no response holds its password."""
    poisoned = _poison(dsettings, dengine)
    settings = dsettings.model_copy(
        update={"console": ConsoleSettings(show_payloads=True, token=None)}
    )
    failed = FailedRows(
        list=lambda topic, limit: list_failed(settings, topic=topic, limit=limit),
        retry=lambda ids: retry_failed(settings, ids),
        discard=lambda ids: purge_failed(settings, ids),
    )
    app = create_app(settings, Backends(DeadLetters(settings), failed), allow_actions=True)
    console = app.state.console
    rendered: set[str] = set()
    get_template = console.templates.get_template

    def tracking(name: Any, *args: Any, **kwargs: Any) -> Any:
        rendered.add(str(name))
        return get_template(name, *args, **kwargs)

    console.templates.get_template = tracking
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")
    letter = {"consumer": poisoned["consumer"], "event_id": poisoned["event_id"]}
    pages = [
        ("GET", "/", None),
        ("GET", "/?fragment=1", None),
        ("GET", "/consumers", None),
        ("GET", "/dead-letters?state=dead&fragment=1", None),
        ("GET", "/dead-letters", None),
        ("GET", f"/dead-letters?consumer={poisoned['consumer']}", None),
        ("GET", "/dead-letters/show", letter),
        ("GET", "/failed?topic=leaky-topic", None),
        ("GET", "/effects?state=unknown", None),
        ("GET", "/effects/show", {"key": poisoned["effect"]}),
        ("GET", "/login", None),
        ("GET", "/dead-letters/show", {"consumer": "none", "event_id": SECRET_URL}),
        ("GET", "/dead-letters?after=" + SECRET_URL, None),
    ]
    try:
        texts = []
        for method, path, params in pages:
            response = await client.request(method, path, params=params)
            assert response.status_code in (200, 400, 404), (path, response.status_code)
            texts.append((path, response.text))
        csrf = console.guard.sessions.get(client.cookies["outbox_console"]).csrf
        key = f'["{poisoned["consumer"]}", "{poisoned["event_id"]}"]'
        for path, form in (
            ("/dead-letters/action", {"action": "replay", "scope": "selected", "key": key}),
            ("/failed/action", {"action": "retry", "scope": "selected", "id": "700001"}),
            ("/effects/action", {"action": "give_up", "key": poisoned["effect"]}),
        ):
            response = await client.post(path, data={**form, "csrf": csrf})
            assert response.status_code == 200, (path, response.text[:500])
            texts.append((path, response.text))
    finally:
        await client.aclose()
        await console.close()
    for path, body in texts:
        for mark in PASSWORD_MARKS:
            assert mark not in body, (path, mark)
    # Every page that shows a stored error shows the URL in it as <url>.
    showing_errors = {
        "/dead-letters",
        f"/dead-letters?consumer={poisoned['consumer']}",
        "/dead-letters/show",
        "/failed?topic=leaky-topic",
        "/effects?state=unknown",
        "/effects/show",
    }
    blanked = {path for path, body in texts if "&lt;url&gt;" in body}
    assert showing_errors <= blanked, sorted(showing_errors - blanked)
    assert rendered >= TEMPLATES, f"templates no test rendered: {sorted(TEMPLATES - rendered)}"
