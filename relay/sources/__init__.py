"""Where a relay reads events: one package per source, each implementing
:class:`~relay.sources.base.Source` (``table/``: rows of the outbox table, claimed in lanes;
``wal/``: logical-decoding messages read from a replication slot).

To add a source: a package here whose source class implements the protocol and has a
``from_settings(settings, shared)`` constructor and a ``wording``, an entry in
:data:`SOURCES`, one in the
registry of what the other tools may assume of it (outbox/sources.py), a value of
``OUTBOX_SOURCE`` (outbox/settings.py), and the producer's way of writing its events
(outbox/producer.py). docs/architecture.md says more.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from outbox.settings import OutboxSettings
from relay.kafka.wording import Wording
from relay.sources.base import Shared, Source
from relay.sources.table.source import TableSource
from relay.sources.wal.source import WalSource


@dataclass(frozen=True)
class SourceEntry:
    wording: Wording  # the publisher's log lines need it before the source is made
    make: Callable[[OutboxSettings, Shared], Source]


SOURCES: dict[str, SourceEntry] = {
    TableSource.name: SourceEntry(TableSource.wording, TableSource.from_settings),
    WalSource.name: SourceEntry(WalSource.wording, WalSource.from_settings),
}


def entry_for(settings: OutboxSettings) -> SourceEntry:
    """The source ``settings`` configure (``OUTBOX_SOURCE``)."""
    return SOURCES[settings.source]
