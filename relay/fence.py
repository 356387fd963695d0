"""Fencing a relay that was frozen: it publishes only while the session that holds its lanes
or the WAL slot has answered recently.

Another relay ends the sessions of a relay silent for ``relay.takeover_seconds`` (T) — no
heartbeat, and each session idle at least that long (relay/takeover.py) — and then owns what
they held. A frozen relay cannot know that happened until it makes a round trip, so before
each publish it asks itself how long ago the last round trip on the holding session was
*sent* (:func:`now`: the longer of two clocks). Under T/2, that session answered a
statement the server finished less than T/2 ago, so no relay can have ended it before T/2
from now: the publish goes. Past T/2, one ``SELECT 1`` on it first: it fails when the
session was ended (the source then drops its batch, as after any lost connection) and
otherwise proves the lock still ours.

What this cannot stop: records the Kafka client had been given before the freeze leave when
the process wakes. They are events the new owner publishes again from the same position, so
they are duplicates the inbox drops, in the same order (docs/operations/frozen-relay.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger("relay")

# A freeze the process cannot see on its monotonic clock: Linux's CLOCK_MONOTONIC stops
# while the host is suspended, and a paused VM's clocks may stop with it. CLOCK_BOOTTIME
# counts a suspend, the wall clock is put right after a pause (NTP): the fence takes the
# longer of the two.
_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)
Stamp = tuple[float, float]
_NEVER: Stamp = (float("-inf"), float("-inf"))


def now() -> Stamp:
    """The fence's clock: (boot time or monotonic, wall clock), both in seconds."""
    steady = time.monotonic() if _BOOTTIME is None else time.clock_gettime(_BOOTTIME)
    return steady, time.time()


def since(then: Stamp, at: Stamp) -> float:
    """Seconds from ``then`` to ``at``: the longer by either clock."""
    return max(at[0] - then[0], at[1] - then[1])


class Fence:
    def __init__(
        self, takeover_seconds: float, prove: Callable[[], Awaitable[object]], holds: str
    ) -> None:
        self._within = takeover_seconds / 2
        self._holds = holds  # what the session holds, for the log line
        self._prove = prove  # one round trip on the holding session; raises when it is gone
        self._proved_at = _NEVER  # when the last answered round trip was sent (now())
        self.proofs = 0  # round trips made by check() (tests, the debug log)

    def answered(self, sent_at: Stamp) -> None:
        """A round trip sent at ``sent_at`` (:func:`now`) on the session came back."""
        if sent_at[0] > self._proved_at[0]:
            self._proved_at = sent_at

    def fresh(self, at: Stamp | None = None) -> bool:
        """The session answered recently enough to publish without asking it again."""
        return since(self._proved_at, now() if at is None else at) < self._within

    async def check(self) -> None:
        """Return when a publish may go; raise the database's error when the session is gone."""
        if self.fresh():
            return
        sent = now()
        try:
            await self._prove()
        except Exception as exc:
            quiet = since(self._proved_at, sent)
            if quiet != float("inf"):
                log.warning(
                    "the session holding %s last answered %.1f s ago and is gone now (%s): "
                    "this relay publishes nothing more from it; another relay may have taken "
                    "over (it was silent: frozen or stopped)",
                    self._holds,
                    quiet,
                    type(exc).__name__,
                )
            raise
        self.proofs += 1
        self.answered(sent)

    def forget(self) -> None:
        """The session is closed: nothing proves ownership until the next one answers."""
        self._proved_at = _NEVER
