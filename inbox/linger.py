"""Fetch linger: fuller fetches while records flow, an immediate fetch after a quiet spell.

At a steady trickle each record would otherwise come in a fetch of its own and run in a
transaction of its own or nearly, and both have a fixed client CPU cost that dwarfs the
per-record work: ~350 µs per aiokafka fetch (request and response are encoded and
decoded in Python, for every assigned partition), ~500-800 µs per inbox transaction with
an ORM handler (three round trips through the async driver, SQLAlchemy's unit of work).
Gathering several records per fetch is the only way to share those costs.

So while records flow, each fetch asks the broker to hold it until about
``LINGER_RECORDS`` records are there or ``linger_ms`` have passed (Kafka's
``fetch.min.bytes``, from the mean size of the records fetched so far, and
``fetch.max.wait.ms``): the records of that window come in one response, go to one
shared transaction, and the next fetch gathers meanwhile. The rate decides which comes
first: above ``LINGER_RECORDS`` per ``linger_ms`` (3,200 records/s at 10 ms) a fetch is
answered as soon as it carries enough to share the fixed costs well, with less than
``linger_ms`` of waiting; below it a record waits at most ``linger_ms`` (half of it on
average). When a fetch brings nothing for ``fetch_timeout_ms``, the
consumer is quiet: fetches go back to the application's own settings (by default: answer
at the first byte, hold up to 500 ms), so an idle consumer costs two fetches a second and
the first record after a pause is handed over at once.

aiokafka fixes both values when it starts; its fetcher reads them again for every
request, from attributes that are not public API, changed through :mod:`outbox.kafka_room`
(checked once at start: if a future aiokafka renames them, lingering is off — said in the
room's one WARNING — and nothing else changes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from outbox.kafka_room import fetch_wait, set_fetch_wait

# Records a lingering fetch waits for (the fetch and the shared transaction it feeds cost
# ~0.5 ms of CPU each, whatever they carry: at 32 records they are ~30 us per record).
LINGER_RECORDS = 32
# The most a lingering fetch waits for, in bytes (large records: the wait ends it).
LINGER_MAX_BYTES = 1 << 20


@dataclass
class FetchLinger:
    consumer: Any  # a started AIOKafkaConsumer
    linger_ms: int
    _quiet: tuple[int, int] = field(init=False)
    _flowing: bool = field(default=False, init=False)
    # Mean bytes per record fetched (moving average), and the fetch size asked for.
    _record_bytes: float = field(default=0.0, init=False)
    _min_bytes: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        quiet = fetch_wait(self.consumer) if self.linger_ms else None
        if quiet is None:
            self.linger_ms = 0  # off: the app tunes fetching, or aiokafka does not let us
        else:
            self._quiet = quiet

    def fetched(self, records: int, size: int = 0) -> None:
        """Called after every fetch wait: how many ``records`` it brought and their
        ``size`` in bytes (key, value and headers)."""
        if not self.linger_ms:
            return
        if records:
            mean = size / records
            last = self._record_bytes
            self._record_bytes = mean if not last else 0.8 * last + 0.2 * mean
            wanted = int(LINGER_RECORDS * self._record_bytes)
            wanted = max(self._quiet[0], min(LINGER_MAX_BYTES, wanted))
            # Changed when the record size moved by a quarter, not at every fetch.
            if self._flowing and abs(wanted - self._min_bytes) * 4 <= self._min_bytes:
                return
            self._flowing, self._min_bytes = True, wanted
            values = (wanted, self.linger_ms)
        elif self._flowing:
            self._flowing, values = False, self._quiet
        else:
            return
        if not set_fetch_wait(self.consumer, *values):
            self.linger_ms = 0
