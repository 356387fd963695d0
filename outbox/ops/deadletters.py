"""What operators see of dead letters: plain records, shared by the inbox that keeps them
(``inbox/store.py``, ``inbox/deadletters.py``) and the console that shows them
(``outbox/console``), which may not import the inbox (docs/architecture.md).

A dead letter's *state* is its inbox row's, as operators read it (:data:`DEAD_LETTER_STATES`);
after a replay that failed again it is ``dead`` again."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

# A dead letter's state, as `outbox dlq` and the console name it, from the inbox row of its
# event (docs/howto/poison-event.md lists the same; tests/unit/test_docs.py compares them).
DEAD_LETTER_STATES = {
    "dead": "the inbox holds it dead-lettered: a replay runs the handler once more",
    "replaying": "replayed, and the consumer has not processed the replayed record yet",
    "processed": "processed since (a replay succeeded): a replay is refused",
    "forgotten": "its inbox row expired (consumer.dedupe_window_days): a replayed copy is "
    "processed like a new event",
}
STATES = tuple(DEAD_LETTER_STATES)
DEAD, REPLAYING, PROCESSED, FORGOTTEN = STATES
# The inbox's status of the event (inbox/sql.py) behind each state; no row: forgotten.
INBOX_STATUS = {DEAD: "dead_lettered", REPLAYING: "replaying", PROCESSED: "processed"}
_STATE_OF_STATUS = {status: state for state, status in INBOX_STATUS.items()}


def state_of(inbox_status: str | None) -> str:
    """The state (one of :data:`STATES`) of a dead letter whose inbox row says
    ``inbox_status``."""
    if inbox_status is None:
        return FORGOTTEN
    return _STATE_OF_STATUS.get(inbox_status, inbox_status)


@dataclass(frozen=True)
class Attempt:
    """One failed attempt behind a dead letter: when, which, why, where and who ran it."""

    at: dt.datetime
    attempt: int  # within its delivery: 1, 2, ... (0: refused without running a handler)
    replay: int  # 0 for the original delivery, n for the n-th replay
    error_class: str
    message: str
    frame: str | None = None  # the first application frame: "path:line in function"
    trace: str | None = None  # the formatted stack trace (bounded, scrubbed)
    host: str | None = None
    pid: int | None = None
    instance: str | None = None  # the group instance id (static membership)
    seconds: float | None = None  # how long the attempt ran before it failed

    def to_json(self) -> dict[str, Any]:
        data = {k: v for k, v in asdict(self).items() if v is not None}
        data["at"] = self.at.isoformat()
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Attempt:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        known["at"] = dt.datetime.fromisoformat(str(data["at"]))
        return cls(**known)

    @property
    def took(self) -> str | None:
        """How long it ran, for people: ``0.4 ms``, ``12.0 ms``, ``3.20 s``."""
        if self.seconds is None:
            return None
        return f"{self.seconds * 1000:.1f} ms" if self.seconds < 1 else f"{self.seconds:.2f} s"

    @property
    def member(self) -> str:
        """Who ran it: the instance id, else host and pid ("-" when unknown)."""
        if self.instance:
            return self.instance
        if self.host:
            return f"{self.host} pid {self.pid}" if self.pid is not None else self.host
        return "-"


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
    # Every failed attempt, oldest first (empty for rows dead-lettered before it was kept).
    history: tuple[Attempt, ...] = field(default=())

    @property
    def state(self) -> str:
        """One of :data:`DEAD_LETTER_STATES`."""
        return state_of(self.inbox_status)

    @property
    def replayable(self) -> bool:
        """Whether a replay can act (one processed since is refused)."""
        return self.state != PROCESSED

    @property
    def trace(self) -> str | None:
        """The stack trace of the latest failure that has one."""
        return next((a.trace for a in reversed(self.history) if a.trace), None)

    @property
    def frame(self) -> str | None:
        return self.history[-1].frame if self.history else None


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
    state: str | None = None  # one of STATES
    # Only what a replay can act on (not processed since).
    replayable: bool = False


@dataclass(frozen=True)
class DeadLetterGroup:
    """Dead letters failing the same way: one error class, one message once its numbers,
    UUIDs and hex ids are blanked (``order 123 not found`` ~ ``order 9 not found``), and
    one first application frame of the latest failure's stack (None when not kept)."""

    group: str  # md5 of the pattern and frame: short enough for a URL, stable
    error_class: str
    pattern: str
    count: int
    consumers: tuple[str, ...]
    first_at: dt.datetime
    last_at: dt.datetime
    frame: str | None = None
    # By state (STATES); how many were ever replayed, and of those how many are dead again
    # (their latest replay failed too).
    states: Mapping[str, int] = field(default_factory=dict)
    replayed: int = 0
    dead_again: int = 0

    @property
    def replayable(self) -> int:
        return self.count - self.states.get(PROCESSED, 0)

    @property
    def still_dead(self) -> int:
        return self.states.get(DEAD, 0)
