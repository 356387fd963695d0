"""A consumer app with a batch handler, run by tests as
`outbox consume tests.support.batch_apps:app`.

``test.event`` goes to a batch handler writing the whole list in one INSERT; ``test.single``
to a per-event handler on the same topic, writing into the same table. Configured by
INBOX_TEST_* environment variables (the library never reads them).
"""

# ruff: noqa: ASYNC230, ASYNC240  (a line per call before the commit or the crash; a stat)

from __future__ import annotations

import asyncio
import json
import os

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

import inbox
from tests.support import diagnostics

NAME = os.environ.get("INBOX_TEST_CONSUMER", "unconfigured")
TOPIC = os.environ.get("INBOX_TEST_TOPIC", "unconfigured")
EFFECTS = os.environ.get("INBOX_TEST_EFFECTS", "unconfigured")
MAX_ATTEMPTS = int(os.environ.get("INBOX_TEST_MAX_ATTEMPTS", "3"))
# Every call's event ids, one JSON list per line, written before the call's commit.
LISTS_FILE = os.environ.get("INBOX_TEST_LISTS_FILE")
# Seconds each call takes before its INSERT, so that a SIGKILL lands inside calls.
CALL_SECONDS = float(os.environ.get("INBOX_TEST_CALL_SECONDS", "0"))
# A list holding an event marked "crash" kills the process (a line here per such call).
RUNS_FILE = os.environ.get("INBOX_TEST_RUNS_FILE")
# While this file does not exist, a list holding an event marked "poison" fails (the bug a
# test "fixes" before replaying the dead letter).
FIXED_FILE = os.environ.get("INBOX_TEST_FIXED_FILE")

app = inbox.Consumer(name=NAME, topics=[TOPIC])
diagnostics.install()  # INBOX_TEST_GROUP_LOG, INBOX_TEST_TASK_DUMPS

INSERT = text(
    f"INSERT INTO {EFFECTS} (event_id, key, seq) "
    "SELECT * FROM unnest(CAST(:ids AS text[]), CAST(:keys AS text[]), CAST(:seqs AS int[]))"
)


@app.handler("test.event", batch=True, max_attempts=MAX_ATTEMPTS)
async def project(events: list[inbox.InboxEvent], session: AsyncSession) -> None:
    bodies = [json.loads(e.value or b"{}") for e in events]
    if LISTS_FILE:
        with open(LISTS_FILE, "a") as f:
            f.write(json.dumps([e.event_id for e in events]) + "\n")
    if any(body.get("crash") for body in bodies):
        if RUNS_FILE:
            with open(RUNS_FILE, "a") as f:
                f.write(f"{len(events)}\n")
        os._exit(3)  # the process dies inside the call: no exception to catch
    fixed = FIXED_FILE is not None and os.path.exists(FIXED_FILE)
    if not fixed and any(body.get("poison") for body in bodies):
        raise RuntimeError("a poison event is in the list")
    for event, body in zip(events, bodies, strict=True):
        if body.get("bad"):
            raise inbox.Permanent("this event can never be projected", event=event)
    if CALL_SECONDS:
        await asyncio.sleep(CALL_SECONDS)
    await session.execute(
        INSERT,
        {
            "ids": [e.event_id for e in events],
            "keys": [body.get("key") for body in bodies],
            "seqs": [body.get("seq") for body in bodies],
        },
    )


@app.handler("test.single", max_attempts=MAX_ATTEMPTS)
async def single(event: inbox.InboxEvent, session: AsyncSession) -> None:
    body = json.loads(event.value or b"{}")
    await session.execute(
        INSERT, {"ids": [event.event_id], "keys": [body.get("key")], "seqs": [body.get("seq")]}
    )
