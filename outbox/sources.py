"""The registry of sources: what each ``OUTBOX_SOURCE`` means to the tools that are not the
relay — the producer, `outbox lag`, `doctor` and `status`, the console, `outbox db`,
`outbox failed` — in one place.

A tool asks the registry (``source_of(settings)``, or ``SOURCES[name]`` for a source a
relay registered with) instead of comparing names, so that a source added to the relay
(relay/sources/) is added here once and every tool follows. The relay's own code for each
source lives in its source package; what is said here is what every other part may rely on.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from outbox.settings import OutboxSettings


@dataclass(frozen=True)
class SourceKind:
    name: str
    # Producers write events as rows of the outbox table, which relays claim in ordering
    # lanes: each lane needs a live relay that owns it.
    owns_lanes: bool
    # Producers write events into the WAL as logical-decoding messages, which one relay
    # reads from a replication slot (a publication, a slot, REPLICATION for its role).
    reads_slot: bool

    def reports_slot(self, slot_exists: bool) -> bool:
        """Whether `lag`, `doctor` and `status` report on the replication slot: always for
        a source that reads one, else when it exists (one left from a switch back to the
        table holds WAL for nobody)."""
        return self.reads_slot or slot_exists

    def needs_table_relays(self, pending: int) -> bool:
        """Whether lanes need live owners, with ``pending`` rows in the outbox table: for a
        lane source always; for another while rows wait there (a switch from the table)."""
        return self.owns_lanes or pending > 0

    @property
    def held_by_table_rows(self) -> bool:
        """Whether unpublished rows of the outbox table hold this source's events back (the
        WAL source publishes nothing newer until they are gone: switching between sources)."""
        return self.reads_slot


TABLE = SourceKind("table", owns_lanes=True, reads_slot=False)
WAL = SourceKind("wal", owns_lanes=False, reads_slot=True)
SOURCES: dict[str, SourceKind] = {kind.name: kind for kind in (TABLE, WAL)}


def source_of(settings: OutboxSettings) -> SourceKind:
    """The source ``settings`` configure (``OUTBOX_SOURCE``)."""
    return SOURCES[settings.source]


def deployed(shell: SourceKind, live: Iterable[str]) -> SourceKind:
    """The source a deployment runs, given the sources its live relays registered with:
    the shell's (``OUTBOX_SOURCE``), unless every live relay runs one other source. A
    console or doctor started from a shell that lacks the deployment's setting then judges
    what runs (no "no live relay" beside streaming WAL relays); while both run (a switch),
    the shell's."""
    kinds = {SOURCES[name] for name in live if name in SOURCES}
    if len(kinds) == 1 and shell not in kinds:
        return kinds.pop()
    return shell
