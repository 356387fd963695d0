"""What operators see of dead letters: plain records, shared by the inbox that keeps them
(``inbox/store.py``, ``inbox/deadletters.py``) and the console that shows them
(``outbox/console``), which may not import the inbox (docs/architecture.md)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass


@dataclass(frozen=True)
class DeadLetter:
    consumer: str
    event_id: str
    topic: str
    partition: int
    offset: int
    event_type: str | None
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    error_class: str
    error_message: str
    attempts: int
    dlq_topic: str
    dlq_partition: int | None
    dlq_offset: int | None
    dlq_refused: str | None  # the topic refused the record as too large (kept here only)
    dead_lettered_at: dt.datetime
    replays: int
    replayed_at: dt.datetime | None
    inbox_status: str | None


@dataclass(frozen=True)
class DeadLetterFilter:
    consumer: str | None = None
    event_id: str | None = None
    topic: str | None = None
    event_type: str | None = None
    error_class: str | None = None
    before: dt.datetime | None = None
    after: dt.datetime | None = None
    # An error group's id (see ``InboxStore.dead_letter_groups``): the same failure.
    group: str | None = None
    # A selection: these (consumer, event_id) pairs only.
    keys: tuple[tuple[str, str], ...] | None = None


@dataclass(frozen=True)
class DeadLetterGroup:
    """Dead letters failing the same way: one error class and one message once its
    numbers, UUIDs and hex ids are blanked (``order 123 not found`` ~ ``order 9 not found``)."""

    group: str  # md5 of the pattern: short enough for a URL, stable across requests
    error_class: str
    pattern: str
    count: int
    consumers: tuple[str, ...]
    first_at: dt.datetime
    last_at: dt.datetime
