"""When a pipeline sleeps with a wake slot (outbox/wake.py): after every claim that finds
nothing, except for a while after wake-ups that kept finding nothing.

A notification wakes every listening relay, and with keys hashed to lanes one relay can
sit idle while another's lanes get every row: each producer transaction would then notify
(serializing producers' commits, the cost the slots exist to avoid) to wake a relay with
nothing to do. After ``FRUITLESS_WAKES`` such wake-ups in a row the pipeline polls without
a slot for ``PAUSE_SECONDS`` (its usual schedule: nothing waits longer than without
wake-ups), then tries again.
"""

from __future__ import annotations

FRUITLESS_WAKES = 3
PAUSE_SECONDS = 1.0


class WakePolicy:
    """One pipeline's: the loop's clock in seconds."""

    def __init__(self) -> None:
        self._fruitless = 0  # wake-ups in a row whose claim found nothing
        self._from = 0.0  # loop time from which the pipeline takes slots again

    def wakeable(self, now: float) -> bool:
        """Whether the next claim takes a slot should it find nothing."""
        return now >= self._from

    def claimed(self, rows: int, woken: bool, now: float) -> None:
        """A claim took ``rows``; ``woken``: the sleep before it ended at a notification."""
        if rows:
            self._fruitless = 0
        elif woken:
            self._fruitless += 1
            if self._fruitless >= FRUITLESS_WAKES:
                self._fruitless, self._from = 0, now + PAUSE_SECONDS
