"""Inbox retention: forget handled event ids after the dedupe window.

A redelivery older than the window would be handled again, so the window must exceed the
longest time a record can be redelivered (topic retention, consumer downtime, replays).
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import Engine

from inbox.store import InboxStore
from outbox.db import translated_errors
from outbox.settings import OutboxSettings
from outbox.tables import build_tables


def delete_expired_inbox_rows(
    settings: OutboxSettings,
    engine: Engine,
    *,
    batch_size: int = 5_000,
    max_batches: int | None = None,
) -> int:
    """Delete inbox rows older than ``consumer.dedupe_window_days``, ``batch_size`` rows
    per transaction, until none are left (or ``max_batches`` ran). Returns rows deleted."""
    store = InboxStore(build_tables(settings))
    window = dt.timedelta(days=settings.consumer.dedupe_window_days)
    total = batches = 0
    with translated_errors():
        while max_batches is None or batches < max_batches:
            with engine.begin() as conn:
                deleted = store.delete_expired(conn, window, batch_size)
            total += deleted
            batches += 1
            if deleted < batch_size:
                break
    return total
