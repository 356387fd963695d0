"""The console's pages (GET): what the operator reads. No SQL here: the same functions as
``outbox lag``/``doctor``/``dlq``/``failed``/``effects``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from outbox.console.consumers import GroupView
from outbox.console.consumers import groups as consumer_views
from outbox.console.filters import DeadLetterQuery, letter_key, page_number
from outbox.console.state import Console, Verbatim
from outbox.ops import consumers
from outbox.ops.deadletters import PROCESSED, STATES, DeadLetterFilter
from outbox.ops.doctor import DoctorOptions, diagnose
from outbox.ops.history import failed_by_day
from outbox.ops.lag import LagReport, collect
from outbox.text import printable

PAGE_SIZE = 100
GROUPS_SHOWN = 50
PAYLOAD_SHOWN = 65_536  # bytes of a payload a page shows; the rest is counted, not sent
EFFECT_STATES = ("unknown", "failed", "pending", "done")


async def _consumers(console: Console) -> tuple[LagReport, list[GroupView]]:
    """The lag report (with Kafka's view of each group) and the consumers' section."""
    settings, engine = console.settings, console.aengine
    report, activity = await asyncio.gather(
        collect(engine, settings, members=True), consumers.activity(engine, settings)
    )
    console.sampler.add(report)
    return report, consumer_views(report.groups, activity, console.sampler)


async def overview(console: Console, request: Request) -> Response:
    settings, engine = console.settings, console.aengine
    (report, groups), findings, letters_by_day, failed_days, unknown = await asyncio.gather(
        _consumers(console),
        diagnose(engine, settings, DoctorOptions(kafka=False)),
        console.backends.dead_letters.by_day(14),
        failed_by_day(engine, settings, 14),
        console.sync(console.effects.records, console.sengine, "unknown", 100),
    )
    days = sorted({d for d, _ in letters_by_day} | {d for d, _ in failed_days}, reverse=True)
    letters, failed = dict(letters_by_day), dict(failed_days)
    return console.render(
        request,
        "overview.html",
        report=report,
        groups=groups,
        problems=[f for f in findings if f.level != "ok"],
        days=[(d, letters.get(d, 0), failed.get(d, 0)) for d in days],
        unknown=unknown,
        chart=console.sampler.chart(),
        sample_seconds=settings.console.sample_seconds,
    )


async def consumers_page(console: Console, request: Request) -> Response:
    report, groups = await _consumers(console)
    return console.render(request, "consumers.html", report=report, groups=groups)


async def dead_letters(console: Console, request: Request) -> Response:
    query = DeadLetterQuery.read(request.query_params)
    page = page_number(request.query_params.get("page"))
    where = query.filter()
    store = console.backends.dead_letters
    states, groups, letters, all_states = await asyncio.gather(
        store.count_by_state(where),
        store.groups(_ungrouped(query), GROUPS_SHOWN),
        store.list(where, PAGE_SIZE, (page - 1) * PAGE_SIZE, newest_first=True),
        store.count_by_state(DeadLetterQuery(query.without("state")).filter()),
    )
    total = sum(states.values())
    return console.render(
        request,
        "dead_letters.html",
        query=query.values,
        groups=groups,
        letters=letters,
        total=total,
        states=states,
        all_states=all_states,
        state_names=STATES,
        replayable=total - states.get(PROCESSED, 0),
        page=page,
        pages=max(1, -(-total // PAGE_SIZE)),
        key_of=letter_key,
        done=request.query_params.get("done"),
    )


def _ungrouped(query: DeadLetterQuery) -> DeadLetterFilter:
    """With a group chosen, the group table still lists every group of the other filters
    (so the operator sees where the chosen one stands)."""
    return DeadLetterQuery(query.without("group")).filter()


async def dead_letter(console: Console, request: Request) -> Response:
    consumer = request.query_params.get("consumer", "")
    event_id = request.query_params.get("event_id", "")
    letter = await console.backends.dead_letters.get(consumer, event_id)
    # Payloads may hold personal data: shown only when the settings say so, and only in
    # the operator's console (--allow-actions), as the CLI never prints them.
    shown = console.settings.console.show_payloads and console.allow_actions
    return console.render(
        request,
        "dead_letter.html",
        x=letter,
        payload=_payload(letter.value, shown),
        payload_shown=shown,
        # Bytes as `outbox dlq show` prints them: NUL and other control bytes, and bytes
        # that are not UTF-8, escaped (\x00, \xff) rather than dropped or replaced.
        key_text=None if letter.key is None else printable(letter.key),
        headers=[(printable(n), printable(v)) for n, v in letter.headers],
        trace_id=_trace_id(letter.headers),
        key=letter_key(letter.consumer, letter.event_id),
    )


def _payload(value: bytes | None, shown: bool) -> dict[str, Any]:
    """JSON pretty-printed; other bytes as text when they decode, else as hex — or, when
    payloads are not ``shown``, only their kind and size."""
    if value is None:
        return {"kind": "tombstone", "size": 0}
    head, size = value[:PAYLOAD_SHOWN], len(value)
    try:
        text = json.dumps(json.loads(value), indent=2, ensure_ascii=False)
        found = {"kind": "json", "text": text[: PAYLOAD_SHOWN * 2], "size": size}
    except ValueError:
        try:
            found = {"kind": "text", "text": head.decode("utf-8"), "size": size}
        except UnicodeDecodeError:
            lines = [
                f"{i:08x}  {head[i : i + 16].hex(' ')}" for i in range(0, min(len(head), 4096), 16)
            ]
            found = {"kind": "bytes", "text": "\n".join(lines), "size": size}
    if not shown:
        return {"kind": found["kind"], "size": size}
    # The operator asked to see it: as it is (escaped), not scrubbed (see state.Verbatim).
    return {**found, "text": Verbatim(found["text"])}


def _trace_id(headers: tuple[tuple[str, bytes], ...]) -> str | None:
    """The trace id of a W3C ``traceparent`` header (version-traceid-spanid-flags)."""
    for name, raw in headers:
        if name == "traceparent":
            parts = raw.decode("ascii", "replace").split("-")
            return parts[1] if len(parts) == 4 else None
    return None


async def failed(console: Console, request: Request) -> Response:
    topic = (request.query_params.get("topic") or "").strip() or None
    rows, total = await console.sync(console.backends.failed.list, topic, PAGE_SIZE * 5)
    return console.render(
        request,
        "failed.html",
        rows=rows,
        total=total,
        topic=topic or "",
        done=request.query_params.get("done"),
    )


async def effects(console: Console, request: Request) -> Response:
    state = request.query_params.get("state") or "unknown"
    if state not in EFFECT_STATES:
        state = "unknown"
    records = await console.sync(console.effects.records, console.sengine, state, PAGE_SIZE * 5)
    return console.render(
        request,
        "effects.html",
        records=records,
        state=state,
        states=EFFECT_STATES,
        done=request.query_params.get("done"),
    )


async def effect(console: Console, request: Request) -> Response:
    key = request.query_params.get("key", "")
    record = await console.sync(console.effects.get, console.sengine, key)
    return console.render(
        request,
        "effect.html",
        r=record,
        result=json.dumps(record.result, indent=2),
        error=json.dumps(record.error, indent=2),
    )
