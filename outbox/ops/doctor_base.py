"""What every group of ``outbox doctor``'s checks shares: the options, the settings and
tables, and the findings they add (outbox/ops/doctor.py runs them all)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from outbox.ops.findings import Finding, Level
from outbox.ops.store import OpsStore
from outbox.ops.wal_slot import SlotState
from outbox.settings import OutboxSettings
from outbox.tables import build_tables


@dataclass(frozen=True)
class DoctorOptions:
    topics: Mapping[str, int | None] = field(default_factory=dict)  # name -> partitions
    idle_seconds: float = 60.0
    snapshot_seconds: float = 60.0
    stale_relay_seconds: float | None = None  # default: five relay heartbeat periods
    skew_warn_seconds: float = 1.0
    dead_ratio: float = 0.2
    dead_min_rows: int = 10_000
    kafka: bool = True


class Checks:
    def __init__(self, settings: OutboxSettings, options: DoctorOptions) -> None:
        self.settings = settings
        self.options = options
        self.tables = build_tables(settings)
        self.store = OpsStore(self.tables)
        self.schema = settings.db_schema
        self.findings: list[Finding] = []
        self.slot: SlotState | None = None  # the WAL source's slot, as check wal read it

    def add(
        self, check: str, level: Level, what: str, action: str | None = None, **details: Any
    ) -> None:
        self.findings.append(Finding(check, level, what, action, details))
