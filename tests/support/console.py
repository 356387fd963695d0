"""Helpers for the console's tests and benchmark: dead letters written straight into the
table (many, fast), the console run as the CLI runs it, and the browser that tests it."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from playwright.async_api import Browser, Page, async_playwright
from sqlalchemy import Engine, insert

from outbox.db import sync_engine
from outbox.settings import OutboxSettings
from outbox.tables import build_tables
from tests.support.inbox import ROOT, subprocess_env

# The screenshots of docs/howto/console.md: into .screenshots/console/ (ignored by git) on
# every run, into docs/assets/console/ with OUTBOX_TEST_SCREENSHOTS=docs, so that a test run
# leaves the working tree clean and the docs change only when asked to.
SHOTS = (
    ROOT / "docs" / "assets" / "console"
    if os.environ.get("OUTBOX_TEST_SCREENSHOTS") == "docs"
    else ROOT / ".screenshots" / "console"
)
CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
# What works headless in a container without a GPU or a sandbox (see docs/development.md).
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium() -> str | None:
    for path in CHROMIUM_CANDIDATES:
        if Path(path).exists():
            return path
    return shutil.which("chromium")


@contextlib.asynccontextmanager
async def chromium_browser() -> AsyncIterator[Browser]:
    """Debian's headless Chromium driven by playwright (a test fails without it)."""
    path = chromium()
    if path is None:
        pytest.fail(
            "chromium not found (/usr/bin/chromium): run scripts/bootstrap, or "
            "apt-get install chromium — the console's browser tests need it",
            pytrace=False,
        )
    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            await b.close()


async def shot(page: Page, name: str, full: bool = False) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    await page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=full)


def seed_dead_letters(
    settings: OutboxSettings,
    n: int,
    *,
    consumer: str = "billing",
    topic: str = "orders",
    error_class: str = "PaymentDeclined",
    message: str = "card ending {i} declined for order {uuid}",
    value: bytes = b'{"order": 1}',
    event_type: str = "order.placed",
) -> list[str]:
    """``n`` dead letters of one consumer (their event ids), inserted in one statement;
    ``message`` may use ``{i}`` and ``{uuid}`` (they differ per letter, the group does not)."""
    table = build_tables(settings).dead_letters
    ids = [str(uuid.uuid4()) for _ in range(n)]
    rows = [
        {
            "consumer": consumer,
            "event_id": event_id,
            "topic": topic,
            "partition": 0,
            "offset": i,
            "event_type": event_type,
            "key": b"k",
            "value": value,
            "header_names": ["ce_id", "ce_type"],
            "header_values": [event_id.encode(), event_type.encode()],
            "error_class": error_class,
            "error_message": message.format(i=i, uuid=uuid.uuid4()),
            "attempts": 3,
            "dlq_topic": f"{topic}.dlq",
            "dlq_partition": 0,
            "dlq_offset": i,
        }
        for i, event_id in enumerate(ids)
    ]
    engine = sync_engine(settings, pool_size=1)
    try:
        with engine.begin() as conn:
            for start in range(0, n, 5_000):
                conn.execute(insert(table), rows[start : start + 5_000])
    finally:
        engine.dispose()
    return ids


def seed_failed_rows(
    engine: Engine, settings: OutboxSettings, ids: list[int], topic: str, last_error: str
) -> None:
    """Rows with these ids in the failed table, as the relay leaves them."""
    with engine.begin() as conn:
        conn.execute(
            insert(build_tables(settings).failed),
            [
                {
                    "id": i,
                    "event_id": uuid.uuid4(),
                    "topic": topic,
                    "key": b"k",
                    "lane": 0,
                    "event_type": "invoice.due",
                    "source": "urn:test",
                    "content_type": "application/json",
                    "payload": b"{}",
                    "fingerprint": b"f",
                    "headers": {},
                    "created_at": dt.datetime.now(dt.UTC),
                    "attempts": 5,
                    "last_error": last_error,
                }
                for i in ids
            ],
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def console_process(
    settings: OutboxSettings, *args: str, **env: str
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``outbox console ARGS`` on a free port (its base URL), stopped at the end."""
    port = free_port()
    extra = {
        "OUTBOX_TABLE_PREFIX": settings.table_prefix,
        "OUTBOX_DB_SCHEMA": settings.db_schema,
        **env,
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "console", "--port", str(port), *args],
        env=subprocess_env(settings, **extra),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"console exited: {proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise AssertionError("console did not answer /healthz within 20 s")
            time.sleep(0.1)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
