"""How the Kafka side's log lines name a relay's events and where they wait: the source says
(the Kafka side knows no source)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Wording:
    records: str  # what its events are called: "rows" of the outbox table, "events"
    waiting: str  # where they wait while Kafka cannot take them: "in the outbox"

    @property
    def wait(self) -> str:
        """ "rows wait in the outbox", for a log line."""
        return f"{self.records} wait {self.waiting}"
