"""What the console needs from the inbox and the relay, as interfaces: the console may not
import either package (dependencies point ``cli -> relay | inbox -> outbox``). The CLI
passes the real objects: ``inbox.DeadLetters`` and ``relay.failed``'s functions."""

from __future__ import annotations

import builtins
import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from outbox.ops.deadletters import DeadLetter, DeadLetterFilter, DeadLetterGroup


class ReplayOutcome(Protocol):
    @property
    def replayed(self) -> builtins.list[DeadLetter]: ...

    @property
    def refused(self) -> builtins.list[DeadLetter]: ...


class DeadLetterStore(Protocol):
    """``inbox.DeadLetters``: the same object ``outbox dlq`` uses."""

    async def list(
        self,
        where: DeadLetterFilter,
        limit: int | None = 100,
        offset: int = 0,
        newest_first: bool = False,
    ) -> builtins.list[DeadLetter]: ...

    async def count(self, where: DeadLetterFilter) -> int: ...

    async def count_by_state(self, where: DeadLetterFilter) -> dict[str, int]: ...

    async def groups(
        self, where: DeadLetterFilter, limit: int = 100
    ) -> builtins.list[DeadLetterGroup]: ...

    async def by_day(self, days: int = 14) -> builtins.list[tuple[dt.date, int]]: ...

    async def get(self, consumer: str, event_id: str) -> DeadLetter: ...

    async def replay(self, where: DeadLetterFilter) -> ReplayOutcome: ...

    async def purge(self, where: DeadLetterFilter) -> int: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class FailedRows:
    """``relay.failed``'s functions with the settings bound (``outbox failed ...``).
    ``list(topic, limit)`` returns (rows, total); ``retry``/``discard`` take ids (never
    empty: the functions read ``None`` as *every row*) and return the ids they moved."""

    list: Callable[[str | None, int], tuple[Sequence[Any], int]]
    retry: Callable[[Sequence[int]], builtins.list[int]]
    discard: Callable[[Sequence[int]], builtins.list[int]]


@dataclass(frozen=True)
class Backends:
    dead_letters: DeadLetterStore
    failed: FailedRows
