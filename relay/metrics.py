"""Prometheus metrics of one relay (served by :func:`outbox.lifecycle.serve_http`).

Each relay has its own ``CollectorRegistry`` so that several relays in one process (tests,
benchmarks) never collide on metric names. Every series exists from the start (counters at
0, the errors counter for each class the relay counts), so dashboards and ``increase()``
never see "no data" before the first event.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from outbox.ops.wal_health import WalGauges
from outbox.status_line import UNKNOWN

# The classes a relay counts in outbox_relay_errors_total (lane connection failures).
ERROR_CLASSES = ("OperationalError", "InterfaceError", "DatabaseUnavailable")
WAL_GAUGES = {
    "retained_bytes": "WAL the server keeps for the slot (current LSN - restart_lsn).",
    "unconfirmed_bytes": "WAL past the slot's confirmed position (current - confirmed_flush_lsn).",
    "lag_seconds": "Age of the oldest committed transaction the slot has not confirmed.",
    "slot_status": "wal_status: 0 reserved, 1 extended, 2 unreserved, 3 lost; -1 no slot.",
    "safe_bytes": "WAL the slot may still fall behind before invalidation (-1: unbounded).",
}


class RelayMetrics:
    def __init__(self, lanes: int = 0) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.published = Counter(
            "outbox_relay_published",
            "Events acknowledged by Kafka and removed/marked.",
            registry=r,
        )
        self.batch_size = Histogram(
            "outbox_relay_batch_size",
            "Rows per claimed batch.",
            registry=r,
            buckets=(1, 10, 50, 100, 250, 500, 1000, 2000, 5000, 10000),
        )
        self.batch_seconds = Histogram(
            "outbox_relay_batch_seconds",
            "Claim to commit time of a batch.",
            registry=r,
            buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.errors = Counter("outbox_relay_errors", "Errors by class.", ["error"], registry=r)
        for name in ERROR_CLASSES:
            self.errors.labels(name)
        self.failed = Counter(
            "outbox_relay_moved_to_failed", "Rows moved to the failed table.", registry=r
        )
        self.owned_lanes = Gauge("outbox_relay_owned_lanes", "Lanes this relay owns.", registry=r)
        self.lanes = Gauge(
            "outbox_relay_lanes",
            "Ordering lanes of the deployment (OUTBOX_LANES): all of them need an owner.",
            registry=r,
        )
        self.lanes.set(lanes)
        self.pending = Gauge(
            "outbox_relay_pending_events", "Rows waiting in the outbox (all lanes).", registry=r
        )
        self.oldest_age = Gauge(
            "outbox_relay_oldest_pending_age_seconds",
            "Age of the oldest pending row, by the database clock.",
            registry=r,
        )
        self.kafka_up = Gauge(
            "outbox_relay_kafka_up",
            "1 while Kafka acknowledges anything; 0 when the relay can publish nothing.",
            registry=r,
        )
        self.partitions_unavailable = Gauge(
            "outbox_relay_partitions_unavailable",
            "Partitions (all topics) whose rows wait in the outbox because Kafka does not "
            "answer for them (a crashed or hung broker); the others keep flowing. The log "
            "says which.",
            registry=r,
        )
        self.dead_rows = Gauge(
            "outbox_relay_outbox_dead_rows",
            "Dead row versions (tuples) in the outbox table that VACUUM has yet to remove "
            "(pg_stat_user_tables.n_dead_tup): what published rows leave behind, not failed "
            "events (outbox_relay_moved_to_failed_total).",
            registry=r,
        )
        self.oldest_snapshot_age = Gauge(
            "outbox_relay_oldest_snapshot_age_seconds",
            "Age of the oldest transaction, snapshot or slot holding back VACUUM in the "
            "outbox's database (0: none).",
            registry=r,
        )
        self.horizon_age = Gauge(
            "outbox_relay_claim_horizon_age_seconds",
            "How old the claim horizon is: rows published since are what claims walk over "
            "while a snapshot is held (-1: no horizon, claims scan lanes from the start).",
            registry=r,
        )
        self.horizon_age.set(-1)
        self.wal = {  # the WAL source's slot (outbox.ops.wal_health.WalGauges); -1: unknown
            name: Gauge(f"outbox_relay_wal_{name}", text, registry=r)
            for name, text in WAL_GAUGES.items()
        }
        self.set_wal(WalGauges.of(None, None))
        self.wal_held = Gauge(
            "outbox_relay_wal_held_events",
            "WAL source: events waiting in memory for partitions Kafka does not answer for "
            "or topics that do not exist yet (with every later event of those); the others "
            "keep flowing.",
            registry=r,
        )
        self.wal_table_holding = Gauge(
            "outbox_relay_wal_table_rows_holding",
            "WAL source: rows of the outbox table older than the next WAL transaction; the "
            "stream waits until they are published, by this relay or a table relay (0: none).",
            registry=r,
        )
        self.takeovers = Counter(
            "outbox_relay_takeovers",
            "Silent relays (no heartbeat for relay.takeover_seconds: frozen) whose idle "
            "database sessions this relay ended, so that their lanes or the WAL slot move on.",
            registry=r,
        )
        self.maintenance_leader = Gauge(
            "outbox_relay_maintenance_leader",
            "1 while this relay runs the maintenance services (retention, the dead-tuple and "
            "snapshot watches): one relay of a deployment at a time.",
            registry=r,
        )
        self.cursor_resets = Counter(
            "outbox_relay_claim_cursor_resets",
            "Lane cursors forgotten because a pending row appeared below one (a writer "
            "outside the outbox's rules: an explicit old id, a row marked unpublished by hand).",
            registry=r,
        )

    def set_wal(self, values: WalGauges) -> None:
        for name, gauge in self.wal.items():
            gauge.set(getattr(values, name))

    def count(self, name: str) -> int:
        """A counter's or gauge's value as an integer (0 when it has none yet)."""
        return int(self.registry.get_sample_value(name) or 0)

    def measured(
        self, name: str, database_up: bool, digits: int | None = None
    ) -> int | float | str:
        """A figure the database gives: ``unknown`` while it is down (a stale gauge is not a
        measurement), and when not read yet (-1)."""
        value = self.registry.get_sample_value(name)
        if value is None or value < 0 or not database_up:
            return UNKNOWN
        return int(value) if digits is None else round(value, digits)

    def status(self) -> dict[str, int | float | str]:
        """The figures every relay's status line has (its source adds its own). Counts are
        integers."""
        return {
            "published": self.count("outbox_relay_published_total"),
            "moved_to_failed": self.count("outbox_relay_moved_to_failed_total"),
            "kafka_up": self.count("outbox_relay_kafka_up"),
            "partitions_unavailable": self.count("outbox_relay_partitions_unavailable"),
        }

    def vacuum_status(self, database_up: bool) -> dict[str, int | float | str]:
        """The maintenance watches' figures (the relay running maintenance has them)."""
        return {
            # Row versions VACUUM has yet to remove, not failed events (moved_to_failed).
            "outbox_dead_tuples": self.measured("outbox_relay_outbox_dead_rows", database_up),
            "oldest_snapshot_seconds": self.measured(
                "outbox_relay_oldest_snapshot_age_seconds", database_up
            ),
        }


# Status-line figures that move while nothing happens: shown, not compared (status_line.py).
STATUS_DRIFTING = (
    "oldest_age_seconds",
    "oldest_snapshot_seconds",
    "wal_lag_seconds",
    "wal_unconfirmed_bytes",
)
