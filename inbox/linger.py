"""Fetch linger: fuller fetches while records flow, an immediate fetch after a quiet spell.

At a steady trickle each record would otherwise come in a fetch of its own and run in a
transaction of its own or nearly, and both have a fixed client CPU cost that dwarfs the
per-record work: ~350 µs per aiokafka fetch (request and response are encoded and
decoded in Python, for every assigned partition), ~500-800 µs per inbox transaction with
an ORM handler (three round trips through the async driver, SQLAlchemy's unit of work).
Gathering several records per fetch is the only way to share those costs.

So while records flow densely, each fetch asks the broker to hold it until a large
amount of data is there or ``linger_ms`` have passed (Kafka's ``fetch.min.bytes`` and
``fetch.max.wait.ms``): the records of that window come in one response, go to one
shared transaction, and the next fetch gathers meanwhile. At high rates the size is
reached first and nothing waits. At a light rate there is nothing to gather: a window
would bring one record or none, which then waits for nothing (half of ``linger_ms`` on
average) and costs a fetch anyway, since a held fetch comes back every ``linger_ms``
while one answered at the first byte comes back once per arrival. So lingering is on only
while the rate measured over the last ``RATE_SECONDS`` would put at least
``ENTER_RECORDS`` records in one window, and off again below ``LEAVE_RECORDS`` (apart,
so that a rate near the line does not flip the setting each period): at the default 5 ms,
on above 600 records/s, off below 300. When a fetch brings nothing for
``fetch_timeout_ms``, the consumer is quiet and lingering is off at once. Off means the
application's own settings (by default: answer at the first byte, hold up to 500 ms), so
an idle consumer costs two fetches a second and a record after a pause, or in a light
stream, is handed over at once.

aiokafka fixes both values when it starts; its fetcher reads them again for every
request, from attributes that are not public API, changed through
:mod:`outbox.kafka.aiokafka_internals` (checked once at start: if a future aiokafka renames
them, lingering is off — said in the room's one WARNING — and nothing else changes).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from outbox.kafka.client import Consumer

# While lingering the wait, not the size, ends a fetch at any rate below ~200 MB/s.
LINGER_MIN_BYTES = 1 << 20
# Records expected per linger window to start lingering, and to keep at it.
ENTER_RECORDS = 3.0
LEAVE_RECORDS = 1.5
# The period over which the rate is counted.
RATE_SECONDS = 0.5


@dataclass
class FetchLinger:
    consumer: Consumer  # started
    linger_ms: int
    clock: Callable[[], float] = time.monotonic
    _quiet: tuple[int, int] = field(init=False)
    _lingering: bool = field(default=False, init=False)
    _counted: int = field(default=0, init=False)
    _since: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        quiet = self.consumer.fetch_wait() if self.linger_ms else None
        if quiet is None:
            self.linger_ms = 0  # off: the app tunes fetching, or aiokafka does not let us
        else:
            self._quiet = quiet

    def fetched(self, records: int) -> None:
        """Called after every fetch wait with the number of records it brought."""
        if not self.linger_ms:
            return
        now = self.clock()
        if not records:  # a quiet spell: the next record is fetched at once
            self._counted, self._since = 0, None
            self._set(False)
            return
        if self._since is None:
            self._since = now  # the stream (re)starts: its rate is not known yet
        self._counted += records
        elapsed = now - self._since
        if elapsed < RATE_SECONDS:
            return
        per_window = self._counted / elapsed * self.linger_ms / 1000
        self._counted, self._since = 0, now
        self._set(per_window >= (LEAVE_RECORDS if self._lingering else ENTER_RECORDS))

    def _set(self, lingering: bool) -> None:
        if lingering == self._lingering:
            return
        self._lingering = lingering
        values = (
            (max(LINGER_MIN_BYTES, self._quiet[0]), self.linger_ms) if lingering else self._quiet
        )
        if not self.consumer.set_fetch_wait(*values):
            self.linger_ms = 0
