"""The side-effect ledger's protocol as steps: one generator (ledger.py, ``Effects._steps``)
yields what to do — run a statement, sleep, commit, make the call, reconcile — and a driver,
sync or async, performs each step and feeds the generator what it produced. The protocol is
written once; only the drivers differ."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from sqlalchemy.sql import Executable


@dataclass(frozen=True)
class Sql:
    statement: Executable
    params: dict[str, Any]


@dataclass(frozen=True)
class Sleep:
    seconds: float


class Commit:
    pass


class Call:
    pass


class Reconcile:
    pass


COMMIT, CALL, RECONCILE = Commit(), Call(), Reconcile()
Step = Sql | Sleep | Commit | Call | Reconcile
Steps = Generator[Step, Any, Any]


@dataclass(frozen=True)
class Finished:
    value: Any


class Feeder:
    """Feeds the protocol generator what its last step produced (a value, or the exception
    it raised) and hands out the next step; the drivers only perform steps."""

    def __init__(self, steps: Steps) -> None:
        self._steps = steps
        self.reply: Any = None
        self.error: Exception | None = None

    def next(self) -> Step | Finished:
        reply, error = self.reply, self.error
        self.reply, self.error = None, None
        try:
            return self._steps.throw(error) if error is not None else self._steps.send(reply)
        except StopIteration as stop:
            return Finished(stop.value)

    def __enter__(self) -> Feeder:
        return self

    def __exit__(self, *exc: object) -> None:
        # A BaseException (cancellation) left the driver: unwind the protocol (the breaker
        # permit goes back); the claim stays to its lease, like a crash.
        self._steps.close()
