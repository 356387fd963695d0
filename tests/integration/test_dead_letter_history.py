"""Why it failed, kept: a real consumer dead-letters an event whose handler fails deep in a
helper; the dead letter keeps the stack trace (the helper's file and line) and every
failed attempt, and replays that fail again append to it. ``outbox dlq show`` (the CLI
as a subprocess) prints both; the log lines say the message."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import uuid
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession

import inbox
from inbox import DeadLetterFilter, DeadLetters
from inbox.event import InboxEvent
from inbox.sql import HISTORY_KEPT
from inbox.store import InboxStore
from outbox.db import async_engine
from outbox.settings import OutboxSettings
from outbox.tables import build_tables
from tests.support.console import chromium_browser, console_process, shot
from tests.support.failing_helpers import FAILING_LINE, invoice_total
from tests.support.inbox import (
    ROOT,
    RunningConsumer,
    ce_headers,
    fast_settings,
    produce,
    subprocess_env,
    wait_for,
)
from tests.support.kafka import create_topic
from tests.support.services import Endpoints
from tests.support.tables import own_tables

pytestmark = pytest.mark.integration
HELPER = "tests/support/failing_helpers.py"
SECRET_URL = "postgresql://svc:pw@db.internal:5432/pay"


class Invoice(BaseModel):
    order: int
    lines: list[dict[str, Any]]


@pytest.fixture(scope="module")
def hsettings(base_settings: OutboxSettings) -> OutboxSettings:
    return own_tables(base_settings, "h")


def _order(order: int) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    body = json.dumps({"order": order, "lines": [{"sku": "a", "qty": 2}]}).encode()
    return f"o{order}".encode(), body, ce_headers(str(uuid.uuid4()), "invoice.requested")


async def _letters(settings: OutboxSettings, consumer: str) -> list[inbox.DeadLetter]:
    letters = DeadLetters(settings)
    try:
        return await letters.list(DeadLetterFilter(consumer=consumer))
    finally:
        await letters.close()


async def test_a_helper_failure_keeps_its_trace_and_every_attempt_across_replays(
    hsettings: OutboxSettings, services: Endpoints
) -> None:
    topic = await create_topic(services.kafka_bootstrap, None, 1)
    app = inbox.Consumer(name=f"invoices-{uuid.uuid4().hex[:6]}", topics=[topic])

    @app.handler("invoice.requested", max_attempts=1)
    async def handle(event: Invoice, session: AsyncSession) -> None:
        invoice_total(event.model_dump())

    settings = fast_settings(hsettings)
    await produce(services.kafka_bootstrap, topic, [_order(1)])
    async with RunningConsumer(app, settings) as c:
        await wait_for(lambda: c.metrics.counts["dead_lettered"] == 1, what="a dead letter")
        for replays in (1, 2):
            letters = DeadLetters(settings)
            try:
                report = await letters.replay(DeadLetterFilter(consumer=app.name))
            finally:
                await letters.close()
            assert len(report.replayed) == 1
            await wait_for(
                lambda n=replays: c.metrics.counts["dead_lettered"] == 1 + n,  # type: ignore[misc]
                what=f"replay {replays} dead-lettered again",
            )
    [letter] = await _letters(settings, app.name)
    assert letter.state == "dead" and letter.replays == 2
    history = letter.history
    assert [(a.replay, a.attempt) for a in history] == [(0, 1), (1, 1), (2, 1)]
    assert [a.error_class for a in history] == ["AttributeError"] * 3
    assert all("'dict' object has no attribute 'total'" in a.message for a in history)
    assert history[0].at < history[1].at < history[2].at  # the first failure is kept
    assert all(a.frame == f"{HELPER}:{FAILING_LINE} in _line_total" for a in history)
    assert all(a.seconds is not None and 0 <= a.seconds < 5 for a in history)
    assert all(a.host and a.pid for a in history)
    trace = letter.trace or ""
    assert f'{HELPER}", line {FAILING_LINE}, in _line_total' in trace
    assert "return line.total * line" in trace  # the source line
    assert "in invoice_total" in trace and "in handle" in trace
    assert "inbox/dispatch.py" not in trace  # the framework's own frames are left out
    assert trace.rstrip().endswith("AttributeError: 'dict' object has no attribute 'total'")

    # `outbox dlq show`: the attempts with their times and errors, and the trace.
    shown = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "cli", "dlq", "show", letter.event_id, "-c", app.name],
        env=subprocess_env(
            settings,
            OUTBOX_TABLE_PREFIX=settings.table_prefix,
            OUTBOX_DB_SCHEMA=settings.db_schema,
            COLUMNS="200",
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    assert "history: 3 failed attempts" in text
    for a in history:
        assert a.at.isoformat(timespec="milliseconds") in text
    assert text.count("AttributeError: 'dict' object has no attribute 'total'") >= 4
    assert "replay 2 attempt 1" in text
    assert f"{HELPER}:{FAILING_LINE} in _line_total" in text
    assert f"line {FAILING_LINE}, in _line_total" in text

    # The console's detail page, in Chromium: the trace, the three attempts.
    with console_process(settings) as (url, _):
        async with chromium_browser() as browser:
            page = await browser.new_page(viewport={"width": 1280, "height": 800})
            await page.goto(
                f"{url}/dead-letters/show?consumer={app.name}&event_id={letter.event_id}"
            )
            trace = await page.inner_text("#trace")
            assert f'{HELPER}", line {FAILING_LINE}, in _line_total' in trace
            assert "return line.total * line" in trace
            assert await page.inner_text("#frame") == f"{HELPER}:{FAILING_LINE} in _line_total"
            attempts = await page.locator("#attempts li").all_inner_texts()
            assert len(attempts) == 3, attempts
            for shown, a in zip(attempts, history, strict=True):
                assert a.at.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC" in shown
                assert "AttributeError: 'dict' object has no attribute 'total'" in shown
            assert "delivery, attempt 1" in attempts[0]
            assert "replay 1, attempt 1" in attempts[1] and "replay 2, attempt 1" in attempts[2]
            await shot(page, "dead-letter-trace", full=True)


async def test_retries_log_their_message_and_the_dead_letter_line_says_where(
    hsettings: OutboxSettings, services: Endpoints, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="outbox.inbox")
    topic = await create_topic(services.kafka_bootstrap, None, 1)
    app = inbox.Consumer(name=f"flaky-{uuid.uuid4().hex[:6]}", topics=[topic])

    @app.handler("invoice.requested")
    async def handle(event: Invoice, session: AsyncSession) -> None:
        raise RuntimeError(f"ledger at {SECRET_URL} refused order {event.order}")

    settings = fast_settings(hsettings, max_attempts=3)
    await produce(services.kafka_bootstrap, topic, [_order(7)])
    async with RunningConsumer(app, settings) as c:
        await wait_for(lambda: c.metrics.counts["dead_lettered"] == 1, what="a dead letter")
    [letter] = await _letters(settings, app.name)
    assert [a.attempt for a in letter.history] == [1, 2, 3]
    assert all(a.message == "ledger at <url> refused order 7" for a in letter.history)
    assert letter.error_message == "ledger at <url> refused order 7"  # scrubbed when kept
    retries = [r for r in caplog.records if r.getMessage() == "handler failed"]
    assert [getattr(r, "error_message", None) for r in retries] == [
        "ledger at <url> refused order 7"
    ] * 2
    [dead] = [r for r in caplog.records if r.getMessage() == "dead-lettered"]
    assert dead.error_message == "ledger at <url> refused order 7"
    assert "test_dead_letter_history.py" in dead.where
    assert "in handle" in dead.trace
    line = (
        logging.Formatter("%(message)s").format(dead)
        + " "
        + " ".join(
            f"{k}={v}" for k, v in vars(dead).items() if k in ("where", "trace", "error_message")
        )
    )
    assert len(line) < 1_000 and "pw@" not in line


async def test_history_keeps_the_first_failure_and_the_latest(hsettings: OutboxSettings) -> None:
    """However many replays fail, the row keeps HISTORY_KEPT attempts: the first and the
    latest (the statement caps it, not the caller)."""
    store = InboxStore(build_tables(hsettings))
    engine = async_engine(hsettings)
    event = InboxEvent(str(uuid.uuid4()), "t", "orders", 0, 1, b"k", b"{}", ())
    try:
        for n in range(HISTORY_KEPT + 5):
            async with engine.begin() as conn:
                await store.add_dead_letter(
                    conn,
                    "capped",
                    event,
                    error_class="Boom",
                    error_message=f"failure {n}",
                    attempts=1,
                    dlq_topic="orders.dlq",
                    dlq_partition=0,
                    dlq_offset=n,
                    history=[
                        {
                            "at": "2026-01-01T00:00:00+00:00",
                            "attempt": 1,
                            "replay": n,
                            "error_class": "Boom",
                            "message": f"failure {n}",
                        }
                    ],
                )
        [letter] = await _letters(hsettings, "capped")
    finally:
        await engine.dispose()
    replays = [a.replay for a in letter.history]
    assert len(replays) == HISTORY_KEPT
    assert replays == [0, *range(HISTORY_KEPT + 5 - (HISTORY_KEPT - 1), HISTORY_KEPT + 5)]
    assert letter.error_message == f"failure {HISTORY_KEPT + 4}"
