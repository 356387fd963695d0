"""A maintenance service: one job of upkeep with its own narrow settings, started and stopped
as one (River's model: each of its maintenance jobs is a service of its own, run only by the
elected leader).

:class:`Periodic` is what every service here is: a bounded round of work every
``interval_seconds``, in a task of its own. A round that meets a database outage (or any
error the framework calls retriable) is logged at WARNING and tried again at the next round;
any other error ends the service and, through :class:`~relay.maintenance.Maintenance`,
stops the relay, as a failed task of the daemon does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

from outbox.errors import OutboxError

log = logging.getLogger("relay.maintenance")


class Service(Protocol):
    name: str

    def start(self) -> asyncio.Task[None]:
        """Start its task (the caller watches it)."""
        ...

    async def stop(self) -> None:
        """Stop it: a round under way is cancelled (every round is safe to cut short)."""
        ...


class Periodic:
    """A service that runs :meth:`round` every ``interval_seconds``."""

    name = "periodic"

    def __init__(self, interval_seconds: float) -> None:
        self.interval_seconds = interval_seconds
        self._task: asyncio.Task[None] | None = None
        self._failing = False  # the last round failed (logged once per spell)

    async def round(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        """Release what its rounds hold (a connection), after the task ended."""

    def start(self) -> asyncio.Task[None]:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"maintenance-{self.name}")
        return self._task

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task  # its failure, if any, was reported by whoever watched it
        await self.close()

    async def _run(self) -> None:
        while True:
            try:
                await self.round()
            except OutboxError as exc:
                if not exc.retriable:
                    raise
                if not self._failing:
                    log.warning(
                        "maintenance round failed; trying again at the next one",
                        extra={"service": self.name, "error": str(exc)},
                    )
                self._failing = True
                await self.close()  # a connection it held may be the broken one
            else:
                self._failing = False
            await asyncio.sleep(self.interval_seconds)
