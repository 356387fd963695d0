"""The consumer app the security tests run as `outbox consume
tests.support.secured_apps:app` over SASL_SSL. Configured by SECURED_TEST_* variables."""

from __future__ import annotations

import json
import os

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

import inbox

NAME = os.environ.get("SECURED_TEST_CONSUMER", "unconfigured")
TOPIC = os.environ.get("SECURED_TEST_TOPIC", "unconfigured")
EFFECTS = os.environ.get("SECURED_TEST_EFFECTS", "unconfigured")

app = inbox.Consumer(name=NAME, topics=[TOPIC])


@app.handler("sec.order", max_attempts=1)
async def record(event: inbox.InboxEvent, session: AsyncSession) -> None:
    body = json.loads(event.value or b"{}")
    if body.get("poison"):
        raise inbox.Permanent("poison order")  # straight to the dead-letter topic
    await session.execute(
        text(f"INSERT INTO {EFFECTS} (event_id, n) VALUES (:e, :n)"),
        {"e": event.event_id, "n": body["n"]},
    )
