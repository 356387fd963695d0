"""The operator console in a real headless Chromium, against the console run as the CLI
runs it, over real PostgreSQL and Kafka (dead letters from a real failing consumer).

The screenshots of docs/howto/console.md are taken here (and by the dead-letter history
test): see tests/support/console.py shot()."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx
import pytest
from playwright.async_api import Browser, Page
from prometheus_client import CollectorRegistry
from pydantic import BaseModel
from sqlalchemy import Engine, func, insert, select, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

import inbox
from inbox import DeadLetterFilter, DeadLetters
from outbox import Message, Outbox
from outbox.effects import Ambiguous, EffectOutcomeUnknown, Effects
from outbox.settings import OutboxSettings
from outbox.tables import build_tables
from tests.support.console import (
    chromium_browser,
    console_process,
    seed_dead_letters,
    seed_failed_rows,
    shot,
)
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
from tests.support.tables import engine_of, own_tables

pytestmark = pytest.mark.integration


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
    with engine_of(csettings) as e:
        yield e


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


REFRESH_SECONDS = 2.0


@pytest.fixture(scope="module")
def consoles(csettings: OutboxSettings) -> Iterator[dict[str, str]]:
    """Two consoles over the same tables: one with --allow-actions that shows payloads and
    refreshes every 2 s, one read-only with the default settings."""
    with (
        console_process(
            csettings,
            "--allow-actions",
            OUTBOX_CONSOLE__SAMPLE_SECONDS="1",
            OUTBOX_CONSOLE__REFRESH_SECONDS=str(REFRESH_SECONDS),
            OUTBOX_CONSOLE__SHOW_PAYLOADS="true",
        ) as (rw, _),
        console_process(csettings) as (ro, _),
    ):
        yield {"rw": rw, "ro": ro}


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    async with chromium_browser() as b:
        yield b


@pytest.fixture
async def page(browser: Browser) -> AsyncIterator[Page]:
    context = await browser.new_context(viewport={"width": 1280, "height": 800})
    p = await context.new_page()
    dialogs: list[str] = []
    p.on("dialog", lambda d: dialogs.append(d.message))
    p.dialogs = dialogs  # type: ignore[attr-defined]
    yield p
    await context.close()


async def test_overview_shows_the_real_backlog_and_consumer_lag(
    scenario: Scenario, consoles: dict[str, str], page: Page
) -> None:
    await page.goto(consoles["rw"] + "/")
    assert await page.inner_text("#pending-total") == "6"
    row = page.locator("#consumers tr", has_text=scenario.app.name)
    assert await row.locator("td.lag").inner_text() == "4"
    assert await row.locator("td.members").inner_text() == "no running member"
    assert "invoices" in await page.inner_text("#topics")
    # The lag chart has its axes: round values in events up the side, UTC times along
    # the bottom (every 10 minutes of the last hour), both with their units.
    chart = page.locator("#lag-chart svg.chart")
    y_labels = await chart.locator(".y-axis text.tick").all_text_contents()
    assert y_labels[0] == "0" and len(y_labels) >= 2
    assert all(label.replace("k", "").replace(".", "").isdigit() for label in y_labels)
    x_labels = await chart.locator(".x-axis text.tick").all_text_contents()
    assert len(x_labels) == 6 and all(re.fullmatch(r"\d\d:\d0", x) for x in x_labels)
    units = await chart.locator("text.unit").all_text_contents()
    assert units == ["events", "time (UTC)"]
    assert await chart.locator("polyline.line.pending").count() >= 1
    # The throughput and handler-time sparklines say their figures in words.
    assert "events/s" in await row.inner_text() and "ms/event" in await row.inner_text()
    await shot(page, "overview", full=True)


async def _shown_with_one_member(page: Page, group: str) -> None:
    """Until the page (refreshing itself) shows ``group`` with one running member."""
    await page.wait_for_function(
        "n => [...document.querySelectorAll('#consumers tr.group-row')]"
        ".some(r => r.textContent.includes(n) && r.querySelector('td.members')"
        ".textContent.trim() === '1')",
        arg=group,
        timeout=30_000,
    )


async def test_a_replay_that_fails_again_counts_as_dead(
    scenario: Scenario, consoles: dict[str, str], page: Page
) -> None:
    """The handler is still broken: replaying the group fails again, and every count says
    the letters are dead (not "not replayed"); the running member is shown with its
    partitions meanwhile."""
    await page.goto(consoles["rw"] + "/")
    async with RunningConsumer(scenario.app, fast_settings(scenario.settings)) as c:
        await _shown_with_one_member(page, scenario.app.name)
        await page.goto(consoles["rw"] + "/consumers")
        member_rows = page.locator(".group-detail", has_text=scenario.app.name).locator(
            ".members-table tr"
        )
        assert await member_rows.count() == 2  # the heading and one member
        detail = await member_rows.nth(1).inner_text()
        assert f"{scenario.topic}[0]" in detail and "since" in detail
        assert "127.0.0.1" in detail  # the host, as the broker sees it
        await shot(page, "consumers", full=True)

        await page.goto(f"{consoles['rw']}/dead-letters?consumer={scenario.app.name}")
        group = page.locator("#groups tr.group", has_text="rejected: sku")
        await group.get_by_role("button", name="Replay 3").click()
        assert await page.inner_text("h1") == "Replay 3 dead letters?"
        await page.click("#confirm")
        await page.wait_for_selector(".done")
        await wait_for(
            lambda: c.metrics.counts["dead_lettered"] >= 3 and c.metrics.counts["processed"] >= 4,
            what="the 3 replays dead-lettered again, the 4 unread processed",
        )
    # Counts that say what is still dead.
    await page.goto(f"{consoles['rw']}/dead-letters?consumer={scenario.app.name}")
    counts = await page.inner_text("#state-counts")
    assert "3 dead" in counts and "0 processed" in counts and "0 replaying" in counts
    group = page.locator("#groups tr.group", has_text="rejected: sku")
    assert "3 dead again" in await group.locator("td.progress").inner_text()
    assert "0 of 3 replayed processed" in await group.locator("td.progress").inner_text()
    assert await group.get_by_role("button", name="Replay 3").count() == 1  # it can act
    states = await page.locator("#letters tr.letter td.state").all_inner_texts()
    assert states == ["dead"] * 3
    await shot(page, "dead-letters-failed-replay")
    await page.goto(consoles["rw"] + "/")
    row = page.locator("#consumers tr.group-row", has_text=scenario.app.name)
    assert "3 still dead of 3" in await row.inner_text()


async def test_a_stopped_consumer_shows_as_no_running_member_within_one_refresh(
    scenario: Scenario, consoles: dict[str, str], page: Page
) -> None:
    await page.goto(consoles["rw"] + "/")
    await page.evaluate("window.notReloaded = true")
    async with RunningConsumer(scenario.app, fast_settings(scenario.settings)):
        await _shown_with_one_member(page, scenario.app.name)
    stopped = time.monotonic()
    await page.wait_for_function(
        "n => [...document.querySelectorAll('#consumers tr.group-row')]"
        ".some(r => r.textContent.includes(n) && r.querySelector('.no-member'))",
        arg=scenario.app.name,
        timeout=30_000,
    )
    # One refresh: the interval, plus the page's own render (Kafka and database calls).
    assert time.monotonic() - stopped < REFRESH_SECONDS + 3
    assert await page.evaluate("window.notReloaded === true")  # no full-page load
    assert "updated" in await page.inner_text("#refresh-status")
    # One click turns the refresh off: the page stops asking.
    await page.click("#refresh-toggle")
    assert await page.inner_text("#refresh-toggle") == "Auto-refresh: off"
    before = await page.inner_text("#refresh-status")
    await page.wait_for_timeout(int(REFRESH_SECONDS * 1000 * 2))
    assert await page.inner_text("#refresh-status") == before
    await page.click("#refresh-toggle")  # on again for the other tests (localStorage)


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
    payload = json.loads(await page.inner_text("#payload"))  # this console shows them
    assert payload["sku"] == "bad"
    assert len(await page.inner_text("#letter")) > 0
    event_id = await page.locator("#letter tr", has_text="event id").locator("td").inner_text()
    assert event_id in scenario.bad
    # Three attempts of the first delivery, three of the failed replay: times and errors.
    attempts = await page.locator("#attempts li").all_inner_texts()
    assert len(attempts) == 6, attempts
    assert all("SkuRejected: order 10" in a and " UTC" in a for a in attempts)
    assert "delivery, attempt 1" in attempts[0] and "replay 1, attempt 3" in attempts[-1]
    assert "test_console.py" in await page.inner_text("#frame")
    assert "in handle" in await page.inner_text("#trace")
    await shot(page, "dead-letter", full=True)
    # A read-only console with the default settings never shows the payload.
    await page.goto(page.url.replace(consoles["rw"], consoles["ro"]))
    assert "Hidden: payloads may hold personal data" in await page.inner_text("#payload-hidden")
    assert await page.locator("#payload").count() == 0
    assert '"sku"' not in await page.content()
    await page.go_back()

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
        await wait_for(lambda: c.metrics.counts["processed"] >= 1, what="the replay")
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


async def test_the_state_filter_and_replay_only_where_it_can_act(
    csettings: OutboxSettings, consoles: dict[str, str], page: Page, cengine: Engine
) -> None:
    consumer = f"states-{uuid.uuid4().hex[:6]}"
    ids = seed_dead_letters(csettings, 4, consumer=consumer, error_class="Stuck")
    inbox_table = build_tables(csettings).inbox
    with cengine.begin() as conn:  # the 4th has no inbox row: forgotten
        conn.execute(
            insert(inbox_table),
            [
                {
                    "consumer": consumer,
                    "event_id": event_id,
                    "topic": "orders",
                    "partition": 0,
                    "offset": n,
                    "status": status,
                }
                for n, (event_id, status) in enumerate(
                    zip(ids, ("dead_lettered", "replaying", "processed"), strict=False)
                )
            ],
        )
    await page.goto(f"{consoles['rw']}/dead-letters?consumer={consumer}")
    counts = await page.inner_text("#state-counts")
    for state in ("dead", "replaying", "processed", "forgotten"):
        assert f"1 {state}" in counts, counts
    group = page.locator("#groups tr.group", has_text="Stuck")
    assert await group.get_by_role("button", name="Replay 3").count() == 1  # not the processed
    for state, event_id in zip(("dead", "replaying", "processed", "forgotten"), ids, strict=True):
        await page.select_option("#state-filter", state)
        await page.get_by_role("button", name="Filter", exact=True).click()
        await page.wait_for_url(f"**state={state}*")
        rows = page.locator("#letters tr.letter")
        assert await rows.count() == 1
        assert await rows.locator("td.state").inner_text() == state
        assert event_id in await rows.inner_text()
        can_replay = page.get_by_role("button", name=re.compile("^Replay the"))
        assert await can_replay.count() == (0 if state == "processed" else 1)
        if state == "processed":
            await shot(page, "dead-letters-state-filter")
            await rows.locator("a").click()
            await page.wait_for_url("**/dead-letters/show?*")
            assert await page.get_by_role("button", name="Replay").count() == 0
            assert "nothing to replay" in await page.inner_text("#letter-section")
            await page.go_back()


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
    seed_failed_rows(cengine, csettings, ids, "gone-topic", "UnknownTopicOrPartitionError")
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
