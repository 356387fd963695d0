"""Which of a relay's pipelines claim: one while the stream is light, all under a backlog.

Every claim is a transaction and a Kafka request or more, whatever it carries. At a steady
moderate rate, two pipelines each polling every ``min_poll_interval_seconds`` make many
claims of a few events each, and cost a third more relay CPU per event than one pipeline,
for the same latency (docs/performance/relay.md). On a busy host that CPU is queueing
delay, in the tail first. So
while the stream is light, the first pipeline claims every lane the relay owns and the
others wait. Two things wake them, and each goes back to its own slice of the lanes until
neither happened for ``BUSY_HOLD_SECONDS``:

* a claim big enough to show a backlog (a quarter of ``batch_size``, or of the pipeline's
  byte share): throughput needs one pipeline claiming while another waits for Kafka;
* a batch that took longer than two poll intervals, claim to commit: rows committed
  meanwhile wait for the next claim, and a second pipeline claiming half of the lanes
  during that wait may keep the tail down on a busy host (the first pipeline alone had the
  worst tail in runs on a loaded host; noisy figures, so this errs on the side of the old
  behaviour: docs/performance/relay.md).

Overlap is safe: while the first pipeline's claim (on every lane) is in flight, another
pipeline's claim on its slice finds those lanes fenced and skips them, exactly as during a
lane rebalance between relays (relay/sources/table/store.py, the claim fence).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from outbox.settings import RelaySettings
from relay.event import Event, payload_bytes

# How long the other pipelines keep claiming after the last big claim or slow batch: a
# backlog drains in big claims back to back, so a second without either means the stream
# is light again.
BUSY_HOLD_SECONDS = 1.0


class Claimers:
    """Shared by the pipelines of one relay (one event loop)."""

    def __init__(self, settings: RelaySettings) -> None:
        self._pipelines = settings.pipelines
        self._slow = 2 * settings.min_poll_interval_seconds
        # Each pipeline's share of the relay's memory budget (see RelayStore.claim).
        self.claim_bytes = max(1, settings.max_inflight_bytes // settings.pipelines)
        self._big_rows = max(1, settings.batch_size // 4)
        self._big_bytes = max(1, self.claim_bytes // 4)
        self._busy_until = -1e9
        self._woken = asyncio.Event()

    def busy(self) -> bool:
        return asyncio.get_running_loop().time() < self._busy_until

    def lanes(self, index: int, owned: Sequence[int]) -> list[int]:
        """The lanes pipeline ``index`` claims now (sorted ``owned``): a slice each while
        busy; all of them for the first pipeline, none for the others, while light."""
        if self._pipelines == 1:
            return list(owned)
        if self.busy():
            return list(owned[index :: self._pipelines])
        return list(owned) if index == 0 else []

    def claimed(self, rows: Sequence[Event]) -> None:
        """A claim took ``rows``: a big one keeps (or makes) every pipeline busy."""
        if len(rows) >= self._big_rows or sum(map(payload_bytes, rows)) >= self._big_bytes:
            self._wake()

    def settled(self, seconds: float) -> None:
        """A batch took ``seconds`` from its claim to its commit: a slow one keeps (or makes)
        every pipeline busy."""
        if seconds >= self._slow:
            self._wake()

    def _wake(self) -> None:
        self._busy_until = asyncio.get_running_loop().time() + BUSY_HOLD_SECONDS
        self._woken.set()
        self._woken.clear()  # wakes the current waiters; later ones wait for the next

    async def wait_busy(self, within: float) -> None:
        """For a pipeline with nothing to claim: until a big claim, at most ``within`` s."""
        if self.busy():
            return
        waiter = asyncio.ensure_future(self._woken.wait())
        try:
            await asyncio.wait({waiter}, timeout=within)
        finally:
            waiter.cancel()
