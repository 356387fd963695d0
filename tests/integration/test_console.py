"""The operator console in a real headless Chromium, against the console run as the CLI
runs it, over real PostgreSQL and Kafka (dead letters from a real failing consumer).

The screenshots of docs/howto/console.md are taken here: into .screenshots/console/ (ignored
by git) on every run, into docs/assets/console/ with OUTBOX_TEST_SCREENSHOTS=docs, so that a
test run leaves the working tree clean and the docs change only when asked to."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx
import pytest
from playwright.async_api import Browser, Page, async_playwright
from prometheus_client import CollectorRegistry
from pydantic import BaseModel
from sqlalchemy import Engine, func, insert, select, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

import inbox
from inbox import DeadLetterFilter, DeadLetters
from outbox import Message, Outbox
from outbox.db import sync_engine
from outbox.effects import Ambiguous, EffectOutcomeUnknown, Effects
from outbox.settings import OutboxSettings
from outbox.tables import build_tables
from tests.support.console import CHROMIUM_ARGS, chromium, console_process, seed_dead_letters
from tests.support.inbox import (
    ROOT,
    RunningConsumer,
    ce_headers,
    effect_counts,
    effects_table,
    fast_settings,
    produce,
    subprocess_env,
    wait_for,
)
from tests.support.kafka import create_topic
from tests.support.services import Endpoints
from tests.support.tables import own_tables

pytestmark = pytest.mark.integration
SHOTS = (
    ROOT / "docs" / "assets" / "console"
    if os.environ.get("OUTBOX_TEST_SCREENSHOTS") == "docs"
    else ROOT / ".screenshots" / "console"
)


class Order(BaseModel):
    order: int
    sku: str


class SkuRejected(Exception):
    """What the bad deploy's handler raises for a valid order."""


@dataclass
class Scenario:
    settings: OutboxSettings
    app: inbox.Consumer
    topic: str
    table: str
    bad: list[str]  # event ids the broken handler dead-lettered
    good: int  # events that must each have exactly one effect in the end
    broken: dict[str, bool]


@pytest.fixture(scope="module")
def csettings(base_settings: OutboxSettings) -> OutboxSettings:
    """Tables of their own: the console shows every row of its tables."""
    return own_tables(base_settings, "c")


@pytest.fixture(scope="module")
def cengine(csettings: OutboxSettings) -> Iterator[Engine]:
    e = sync_engine(csettings, pool_size=2)
    yield e
    e.dispose()


def _record(order: int, sku: str) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    body = json.dumps({"order": order, "sku": sku}).encode()
    tp = f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-01"
    return (
        f"o{order}".encode(),
        body,
        ce_headers(str(uuid.uuid4()), "order.placed", traceparent=tp),
    )


@pytest.fixture(scope="module")
async def scenario(csettings: OutboxSettings, cengine: Engine, services: Endpoints) -> Scenario:
    """After a bad deploy: a real consumer dead-lettered 3 orders (same error, different
    order numbers), processed 2, then stopped with 4 records unread (consumer lag 4); the
    outbox holds 6 unpublished events (no relay runs: backlog 6)."""
    kafka_bootstrap = services.kafka_bootstrap
    topic = await create_topic(kafka_bootstrap, None, 1)
    table = effects_table(cengine)
    broken = {"on": True}
    app = inbox.Consumer(name=f"billing-{uuid.uuid4().hex[:6]}", topics=[topic])

    @app.handler("order.placed")
    async def handle(event: Order, session: AsyncSession) -> None:
        if broken["on"] and event.sku == "bad":
            raise SkuRejected(f"order {event.order} rejected: sku {event.sku!r} unknown")
        await session.execute(
            text(f"INSERT INTO {table} (event_id, key, seq) VALUES (:e, :k, :s)"),
            {"e": f"order-{event.order}", "k": event.sku, "s": event.order},
        )

    records = [_record(101, "bad"), _record(1, "ok"), _record(102, "bad")]
    records += [_record(2, "ok"), _record(103, "bad")]
    await produce(kafka_bootstrap, topic, records)
    async with RunningConsumer(app, fast_settings(csettings)) as c:
        await wait_for(
            lambda: c.metrics.counts["dead_lettered"] >= 3 and c.metrics.counts["processed"] >= 2,
            what="3 dead letters and 2 processed",
        )
    await produce(kafka_bootstrap, topic, [_record(n, "ok") for n in range(3, 7)])
    with Session(cengine) as session, session.begin():
        Outbox(csettings).publish_many(
            session,
            [
                Message(topic="invoices", key=f"i{n}", event_type="invoice.due", payload={"n": n})
                for n in range(6)
            ],
        )
    letters = DeadLetters(csettings)
    try:
        bad = [x.event_id for x in await letters.list(DeadLetterFilter(consumer=app.name))]
    finally:
        await letters.close()
    assert len(bad) == 3
    return Scenario(csettings, app, topic, table, bad, 2 + 4, broken)


@pytest.fixture(scope="module")
def consoles(csettings: OutboxSettings) -> Iterator[dict[str, str]]:
    """Two consoles over the same tables: one with --allow-actions, one read-only."""
    with (
        console_process(csettings, "--allow-actions", OUTBOX_CONSOLE__SAMPLE_SECONDS="1") as (
            rw,
            _,
        ),
        console_process(csettings) as (ro, _),
    ):
        yield {"rw": rw, "ro": ro}


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    path = chromium()
    if path is None:
        pytest.fail(
            "chromium not found (/usr/bin/chromium): run scripts/bootstrap, or "
            "apt-get install chromium — the console's browser tests need it",
            pytrace=False,
        )
    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS, headless=True)
        yield b
        await b.close()


@pytest.fixture
async def page(browser: Browser) -> AsyncIterator[Page]:
    context = await browser.new_context(viewport={"width": 1280, "height": 800})
    p = await context.new_page()
    dialogs: list[str] = []
    p.on("dialog", lambda d: dialogs.append(d.message))
    p.dialogs = dialogs  # type: ignore[attr-defined]
    yield p
    await context.close()


async def shot(page: Page, name: str, full: bool = False) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    await page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=full)


async def test_overview_shows_the_real_backlog_and_consumer_lag(
    scenario: Scenario, consoles: dict[str, str], page: Page
) -> None:
    await page.goto(consoles["rw"] + "/")
    assert await page.inner_text("#pending-total") == "6"
    row = page.locator("#consumers tr", has_text=scenario.app.name)
    assert await row.locator("td.lag").inner_text() == "4"
    assert "invoices" in await page.inner_text("#topics")
    await shot(page, "overview", full=True)


async def test_dead_letter_from_a_failing_handler_is_grouped_opened_and_replayed_once(
    scenario: Scenario, consoles: dict[str, str], page: Page, cengine: Engine
) -> None:
    await page.goto(f"{consoles['rw']}/dead-letters?consumer={scenario.app.name}")
    group = page.locator("#groups tr.group", has_text="rejected: sku")
    assert await group.locator("td").first.inner_text() == "3"
    assert "order <n> rejected: sku 'bad' unknown" in await group.inner_text()
    await group.locator("a").first.click()
    await page.wait_for_url("**group=*")
    assert await page.locator("#letters tr.letter").count() == 3
    await shot(page, "dead-letters")

    await page.locator("#letters tr.letter a").first.click()
    await page.wait_for_url("**/dead-letters/show?*")
    assert "SkuRejected: order 10" in await page.inner_text("#error")
    payload = json.loads(await page.inner_text("#payload"))
    assert payload["sku"] == "bad"
    assert len(await page.inner_text("#letter")) > 0
    event_id = await page.locator("#letter tr", has_text="event id").locator("td").inner_text()
    assert event_id in scenario.bad
    await shot(page, "dead-letter", full=True)

    # The fix is deployed: the handler accepts the order now. The consumer runs again (and
    # catches up on the 4 records it had not read).
    scenario.broken["on"] = False
    async with RunningConsumer(scenario.app, fast_settings(scenario.settings)) as c:
        await page.get_by_role("button", name="Replay").click()
        await page.wait_for_url("**/dead-letters/action")
        assert "Replay 1 dead letter" in await page.inner_text("h1")
        await shot(page, "confirm")
        await page.click("#confirm")
        await page.wait_for_selector(".done")
        assert "replayed 1, refused 0" in await page.inner_text(".done")
        await wait_for(
            lambda: c.metrics.counts["processed"] >= 5, what="the replay and the 4 unread"
        )
    counts = effect_counts(cengine, scenario.table)
    replayed = [k for k in counts if k.startswith("order-10")]
    assert len(replayed) == 1, counts
    expected = scenario.good + 1
    lost = expected - len(counts)
    duplicates = sum(n - 1 for n in counts.values())
    assert (lost, duplicates) == (0, 0), counts
    await page.goto(
        f"{consoles['rw']}/dead-letters/show?consumer={scenario.app.name}&event_id={event_id}"
    )
    assert await page.inner_text("#state") == "processed"


async def test_a_group_of_50_is_purged_with_one_confirmation(
    csettings: OutboxSettings, consoles: dict[str, str], page: Page
) -> None:
    seed_dead_letters(
        csettings,
        50,
        consumer="shipping",
        error_class="LabelPrinterOffline",
        message="printer {i} offline (job {uuid})",
    )
    await page.goto(f"{consoles['rw']}/dead-letters?consumer=shipping")
    group = page.locator("#groups tr.group", has_text="LabelPrinterOffline")
    await group.get_by_role("button", name="Purge 50").click()
    assert await page.inner_text("h1") == "Purge 50 dead letters?"
    await page.click("#confirm")
    await page.wait_for_selector(".done")
    assert "purged 50" in await page.inner_text(".done")
    letters = DeadLetters(csettings)
    try:
        assert await letters.count(DeadLetterFilter(consumer="shipping")) == 0
    finally:
        await letters.close()


async def test_a_script_payload_is_shown_as_text(
    csettings: OutboxSettings, consoles: dict[str, str], page: Page
) -> None:
    script = "<script>alert(1)</script>"
    [event_id] = seed_dead_letters(
        csettings,
        1,
        consumer="xss",
        error_class="Boom",
        message="<img src=x onerror=alert(2)>",
        value=json.dumps({"note": script}).encode(),
    )
    await page.goto(f"{consoles['rw']}/dead-letters?consumer=xss")
    assert "<img src=x onerror=alert(2)>" in await page.inner_text("#letters")
    await page.goto(f"{consoles['rw']}/dead-letters/show?consumer=xss&event_id={event_id}")
    assert script in await page.inner_text("#payload")
    assert "&lt;script&gt;" in await page.content() or script not in await page.content()
    await page.wait_for_timeout(200)
    assert page.dialogs == []  # type: ignore[attr-defined]


def test_a_post_without_the_csrf_token_is_refused(
    csettings: OutboxSettings, consoles: dict[str, str]
) -> None:
    seed_dead_letters(csettings, 1, consumer="csrf")
    form = {"action": "purge", "scope": "filtered", "consumer": "csrf", "confirmed": "yes"}
    for sent in (form, {**form, "csrf": "forged"}):
        response = httpx.post(f"{consoles['rw']}/dead-letters/action", data=sent)
        assert response.status_code == 403
        assert "CSRF" in response.text
    page = httpx.get(f"{consoles['rw']}/dead-letters?consumer=csrf").text
    assert "1 dead letter " in page  # still there


def test_read_only_mode_shows_no_action_and_refuses_action_posts(
    csettings: OutboxSettings, consoles: dict[str, str]
) -> None:
    seed_dead_letters(csettings, 2, consumer="readonly")
    listing = httpx.get(f"{consoles['ro']}/dead-letters?consumer=readonly")
    assert listing.status_code == 200 and "2 dead letters" in listing.text
    for action in ("replay", "purge"):
        assert f'value="{action}"' not in listing.text
    assert "read-only" in listing.text
    form = {"action": "purge", "scope": "filtered", "consumer": "readonly", "confirmed": "yes"}
    refused = httpx.post(f"{consoles['ro']}/dead-letters/action", data=form)
    assert refused.status_code == 403 and "read-only" in refused.text
    assert "2 dead letters" in httpx.get(f"{consoles['ro']}/dead-letters?consumer=readonly").text


def test_binding_beyond_loopback_without_a_token_refuses_to_start(
    csettings: OutboxSettings,
) -> None:
    env = subprocess_env(csettings)
    env.pop("OUTBOX_CONSOLE__TOKEN", None)
    done = subprocess.run(
        [sys.executable, "-m", "cli", "console", "--host", "0.0.0.0"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        timeout=30,
    )
    lines = done.stderr.decode().strip().splitlines()
    assert done.returncode == 2
    assert len(lines) == 1 and "OUTBOX_CONSOLE__TOKEN" in lines[0], lines
    assert "Traceback" not in done.stderr.decode()


def test_pages_carry_a_content_security_policy_and_no_secret(
    csettings: OutboxSettings, consoles: dict[str, str]
) -> None:
    url = csettings.database_url.get_secret_value()
    for path in ("/", "/dead-letters", "/failed", "/effects?state=unknown", "/healthz"):
        response = httpx.get(consoles["rw"] + path, timeout=30)
        assert response.status_code == 200, path
        assert "script-src 'self'" in response.headers["content-security-policy"]
        assert url not in response.text and "postgresql+psycopg://" not in response.text, path


async def test_an_unknown_effect_is_given_up_and_a_failed_row_retried_from_the_pages(
    csettings: OutboxSettings, consoles: dict[str, str], page: Page, cengine: Engine
) -> None:
    effects = Effects(csettings, registry=CollectorRegistry())
    key = f"refund-{uuid.uuid4().hex[:8]}"

    def lost_answer(k: str) -> None:
        raise Ambiguous("read timed out after the request was sent")

    with pytest.raises(EffectOutcomeUnknown):
        effects.run(cengine, key=key, call=lost_answer, dependency="payments")
    await page.goto(f"{consoles['rw']}/effects?state=unknown")
    await page.get_by_role("link", name=key).click()
    await page.get_by_role("button", name="Give up").click()
    await page.click("#confirm")
    await page.wait_for_selector(".done")
    record = effects.get(cengine, key)
    assert record.state == "failed" and record.error is not None
    assert record.error["type"] == "GivenUp"

    failed = build_tables(csettings).failed
    ids = [900_001, 900_002]
    with cengine.begin() as conn:
        conn.execute(
            insert(failed),
            [
                {
                    "id": i,
                    "event_id": uuid.uuid4(),
                    "topic": "gone-topic",
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
                    "last_error": "UnknownTopicOrPartitionError",
                }
                for i in ids
            ],
        )
    await page.goto(f"{consoles['rw']}/failed?topic=gone-topic")
    await page.locator(f"#failed input[value='{ids[0]}']").check()
    await page.get_by_role("button", name="Retry selected").click()
    assert await page.inner_text("h1") == "Retry 1 failed outbox row?"
    await page.click("#confirm")
    await page.wait_for_selector(".done")
    assert "retry 1" in await page.inner_text(".done")
    with cengine.connect() as conn:
        left = conn.execute(select(failed.c.id)).scalars().all()
        events = build_tables(csettings).events
        back = conn.execute(select(func.count()).where(events.c.topic == "gone-topic")).scalar_one()
    assert ids[0] not in left and ids[1] in left and back == 1
