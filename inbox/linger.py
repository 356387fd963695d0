"""Fetch linger: fuller fetches while records flow, an immediate fetch after a quiet spell.

At a steady trickle each record would otherwise come in a fetch of its own and run in a
transaction of its own or nearly, and both have a fixed client CPU cost that dwarfs the
per-record work: ~350 µs per aiokafka fetch (request and response are encoded and
decoded in Python, for every assigned partition), ~500-800 µs per inbox transaction with
an ORM handler (three round trips through the async driver, SQLAlchemy's unit of work).
Gathering several records per fetch is the only way to share those costs.

So while records flow, each fetch asks the broker to hold it until a large amount of
data is there or ``linger_ms`` have passed (Kafka's ``fetch.min.bytes`` and
``fetch.max.wait.ms``): the records of that window come in one response, go to one
shared transaction, and the next fetch gathers meanwhile. At high rates the size is
reached first and nothing waits; at a trickle a record waits at most ``linger_ms``
(half of it on average). When a fetch brings nothing for ``fetch_timeout_ms``, the
consumer is quiet: fetches go back to the application's own settings (by default: answer
at the first byte, hold up to 500 ms), so an idle consumer costs two fetches a second and
the first record after a pause is handed over at once.

aiokafka fixes both values when it starts; its fetcher reads them again for every
request, from attributes that are not public API, changed through
:mod:`outbox.kafka.aiokafka_internals` (checked once at start: if a future aiokafka renames
them, lingering is off — said in the room's one WARNING — and nothing else changes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from outbox.kafka.client import Consumer

# While lingering the wait, not the size, ends a fetch at any rate below ~200 MB/s.
LINGER_MIN_BYTES = 1 << 20


@dataclass
class FetchLinger:
    consumer: Consumer  # started
    linger_ms: int
    _quiet: tuple[int, int] = field(init=False)
    _flowing: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        quiet = self.consumer.fetch_wait() if self.linger_ms else None
        if quiet is None:
            self.linger_ms = 0  # off: the app tunes fetching, or aiokafka does not let us
        else:
            self._quiet = quiet

    def fetched(self, records: bool) -> None:
        """Called after every fetch wait: ``records`` whether it brought any."""
        if not self.linger_ms or records == self._flowing:
            return
        self._flowing = records
        lingering = (max(LINGER_MIN_BYTES, self._quiet[0]), self.linger_ms)
        values = lingering if records else self._quiet
        if not self.consumer.set_fetch_wait(*values):
            self.linger_ms = 0
