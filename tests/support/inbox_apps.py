"""Consumer apps run by tests as `outbox consume tests.support.inbox_apps:app`.

Configured by INBOX_TEST_* environment variables (a test module may read them; the
library never does).
"""

# ruff: noqa: ASYNC230, ASYNC240  (tiny marker files written right before the process dies)

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

import inbox
from inbox import offsets
from tests.support import diagnostics

NAME = os.environ.get("INBOX_TEST_CONSUMER", "unconfigured")
TOPIC = os.environ.get("INBOX_TEST_TOPIC", "unconfigured")
EFFECTS = os.environ.get("INBOX_TEST_EFFECTS", "unconfigured")
MODE = os.environ.get("INBOX_TEST_MODE", "normal")
RUNS_FILE = os.environ.get("INBOX_TEST_RUNS_FILE")
MAX_ATTEMPTS = int(os.environ.get("INBOX_TEST_MAX_ATTEMPTS", "3"))
# While this file does not exist, events marked "permanent" fail with inbox.Permanent (the
# bug a test "fixes" before replaying them).
FIXED_FILE = os.environ.get("INBOX_TEST_FIXED_FILE")

app = inbox.Consumer(name=NAME, topics=[TOPIC])

diagnostics.install()  # INBOX_TEST_GROUP_LOG, INBOX_TEST_TASK_DUMPS


@app.handler("test.event", max_attempts=MAX_ATTEMPTS)
async def record(event: inbox.InboxEvent, session: AsyncSession) -> None:
    body = json.loads(event.value or b"{}")
    if body.get("crash"):
        if RUNS_FILE:
            with open(RUNS_FILE, "a") as f:
                f.write(event.event_id + "\n")
        os._exit(3)  # the process dies inside the handler: no exception to catch
    if body.get("permanent") and not (FIXED_FILE and Path(FIXED_FILE).exists()):
        raise inbox.Permanent("this event cannot be applied (until the handler is fixed)")
    await session.execute(
        text(f"INSERT INTO {EFFECTS} (event_id, key, seq) VALUES (:e, :k, :s)"),
        {"e": event.event_id, "k": body.get("key"), "s": body.get("seq")},
    )


if MODE == "kill_after_commit" and RUNS_FILE:
    # SIGKILL the process right after the first database commit, before its offsets are
    # committed to Kafka: the restarted consumer re-reads what was already applied.
    _commit = offsets.OffsetCommitter._commit
    _marker = Path(RUNS_FILE)

    async def _kill_before_offset_commit(
        self: offsets.OffsetCommitter, pending: dict[object, int]
    ) -> bool:
        if not _marker.exists():
            _marker.write_text(str(max(pending.values())))
            os.kill(os.getpid(), signal.SIGKILL)
        return await _commit(self, pending)  # type: ignore[arg-type]

    offsets.OffsetCommitter._commit = _kill_before_offset_commit  # type: ignore[method-assign,assignment]
