"""Rows past (or within) retention in every table maintenance cleans: the outbox's neighbours
(inbox, idempotency keys, effect records), for the cleanup and maintenance tests."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import Engine, func, insert, select, text

from outbox.settings import OutboxSettings
from outbox.tables import build_tables


def ago(spec: str) -> Any:
    return func.now() - text(f"interval '{spec}'")


def counts(engine: Engine, s: OutboxSettings) -> dict[str, int]:
    t = build_tables(s)
    with engine.connect() as conn:
        return {
            name: int(conn.execute(select(func.count()).select_from(table)).scalar_one())
            for name, table in (
                ("events", t.events),
                ("inbox", t.inbox),
                ("idempotency", t.idempotency),
                ("effects", t.effects),
                ("failed", t.failed),
            )
        }


def add_inbox(engine: Engine, s: OutboxSettings, n: int, processed: str) -> None:
    inbox = build_tables(s).inbox
    with engine.begin() as conn:
        for i in range(n):
            conn.execute(
                insert(inbox).values(
                    consumer="c1", event_id=f"{processed}-{i}", topic="t", partition=0,
                    offset=i, status="processed", processed_at=ago(processed),
                )
            )  # fmt: skip


def add_idempotency(engine: Engine, s: OutboxSettings, n: int, expires: Any) -> None:
    keys = build_tables(s).idempotency
    with engine.begin() as conn:
        for _ in range(n):
            conn.execute(
                insert(keys).values(
                    scope="s", key=uuid.uuid4().hex, payload_hash="h", status="complete",
                    expires_at=expires,
                )
            )  # fmt: skip


def add_effects(engine: Engine, s: OutboxSettings, n: int, state: str, expires: Any) -> None:
    ledger = build_tables(s).effects
    with engine.begin() as conn:
        for _ in range(n):
            conn.execute(
                insert(ledger).values(
                    key=uuid.uuid4().hex, payload_hash="h", state=state, dependency="d",
                    dedupe_window=text("interval '1 day'"), expires_at=expires,
                )
            )  # fmt: skip
