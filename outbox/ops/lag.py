"""Outbox and consumer lag: the numbers behind ``outbox lag``.

What each figure means, and where it comes from:

* ``pending`` - outbox rows not yet published (``published_at IS NULL``), per topic;
  ``due`` - those of them whose ``available_at`` has passed (the rest were delayed on
  purpose by the producer).
* ``oldest_pending_age_seconds`` - ``now() - min(available_at)`` over the due rows, on the
  database clock (so app-server clock skew cannot distort it). For an event published
  without a delay, ``available_at`` equals ``created_at``.
* ``failed`` - rows the relay moved to the failed table (Kafka rejected them permanently).
* ``publish_rate_per_second`` - in keep-mode (``relay.keep_published_hours > 0``) the rows
  marked published during the last 60 s, divided by 60: exact. In delete-mode published
  rows are gone, so the rate is the growth of the topic's Kafka end offsets between two
  samples (up to 60 s apart while watching; ``rate_sample_seconds`` apart for a one-shot
  look). That counts every producer writing to the topic, not only the relay; the
  ``rate_source`` field says which method produced the figure.
* consumer groups - per partition, Kafka end offset minus the group's committed offset (a
  partition the group never committed counts everything still retained); dead letters
  from the inbox's dead-letter table. Without an answer from Kafka (``--no-kafka``, Kafka
  unreachable) a group's lag is unknown (``None``), never 0.
* relays - rows of the relays table, one per relay whatever its source (``source``: the
  outbox table or the WAL), with the relay's host and process id; a relay is alive when its
  heartbeat is younger than ``stale_after`` seconds (default: five heartbeat periods);
  ``maintenance`` marks the one that runs the maintenance services. ``unowned_lanes`` lists
  lanes no live relay owns, when lanes need owners (outbox/sources.py: always for the table
  source, for the WAL source while rows wait in the table): their rows are not being
  published.
* vacuum - the outbox's dead rows (``pg_stat_user_tables.n_dead_tup``) and the oldest
  transaction, snapshot or slot holding back VACUUM in the database (outbox/ops/vacuum.py).
* wal - the WAL source's slot (in WAL mode, or whenever the slot exists): ``retained_bytes``
  the WAL the server keeps for it (current LSN - ``restart_lsn``), ``unconfirmed_bytes`` the
  WAL past its confirmed position (current LSN - ``confirmed_flush_lsn``), ``wal_status``,
  ``safe_wal_size``, and ``lag_seconds``: the age, by the database clock, of the oldest
  committed transaction the slot has not confirmed, read from a temporary copy of the slot
  (outbox/ops/wal_slot.py; needs REPLICATION, else ``lag_unknown`` says why); the WAL
  relays connected to the database, the one reading (``reading_pids``) and those standing by.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Literal

from aiokafka import TopicPartition
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from outbox.db import translated_errors
from outbox.errors import OutboxError
from outbox.ops.consumers import GroupState
from outbox.ops.kafka_probe import KafkaProbe
from outbox.ops.store import OpsStore
from outbox.ops.vacuum import VacuumState, vacuum_state
from outbox.ops.wal_lag import LagProbe, lag_seconds
from outbox.ops.wal_slot import WalState, read_state
from outbox.settings import OutboxSettings
from outbox.sources import deployed, source_of
from outbox.tables import build_tables
from outbox.wording import counted

RATE_WINDOW_SECONDS = 60.0


def default_stale_after(settings: OutboxSettings) -> float:
    """Heartbeat age after which a relay counts as gone: five missed heartbeats."""
    return max(5.0, 5 * settings.relay.heartbeat_seconds)


@dataclass
class TopicLag:
    topic: str
    pending: int = 0
    due: int = 0
    oldest_pending_age_seconds: float | None = None
    failed: int = 0
    publish_rate_per_second: float | None = None
    rate_source: str | None = None
    partitions: int | None = None  # from Kafka; None when unknown
    exists: bool | None = None  # in Kafka; None when Kafka was not asked or unreachable


@dataclass
class PartitionLag:
    topic: str
    partition: int
    end_offset: int
    committed: int | None  # None: the group never committed this partition
    lag: int


@dataclass
class GroupLag:
    group: str
    partitions: list[PartitionLag] = field(default_factory=list)
    dead_letters: int = 0
    dead_letters_not_replayed: int = 0
    # Dead letters whose inbox row still says dead-lettered: never replayed, or replayed
    # and failed again.
    dead_letters_still_dead: int = 0
    dead_letters_last_hour: int = 0
    error: str | None = None
    # False until Kafka answered for this group: with Kafka not asked (--no-kafka) or
    # unreachable, the lag is unknown — never reported as 0.
    measured: bool = True
    # Kafka's description of the group (``collect(..., members=True)``; None: not asked or
    # not answered): its state and running members.
    described: GroupState | None = None

    @property
    def total_lag(self) -> int | None:
        return sum(p.lag for p in self.partitions) if self.measured else None


@dataclass
class RelayInfo:
    relay_id: str
    hostname: str
    pid: int  # the relay process's (never a database backend's)
    started_at: datetime
    heartbeat_age_seconds: float
    lanes: list[int]
    alive: bool
    source: str = "table"  # where it reads events (OUTBOX_SOURCE)
    maintenance: bool = False  # it runs the maintenance services


@dataclass
class WalLag:
    slot: str
    exists: bool
    wal_status: str | None = None
    active: bool | None = None
    retained_bytes: int | None = None
    unconfirmed_bytes: int | None = None
    safe_wal_size: int | None = None  # None: unbounded
    max_slot_wal_keep_size: int | None = None  # -1: unbounded
    confirmed_flush_lsn: str | None = None
    lag_seconds: float | None = None
    lag_unknown: str | None = None  # why lag_seconds is None
    reading_pids: list[int] = field(default_factory=list)  # the WAL relay reading the slot
    standby_pids: list[int] = field(default_factory=list)  # WAL relays standing by
    # Who reads, in words: "relay pid 1234 on host-a (backend pid 5678)" (the pids above
    # are PostgreSQL's backends, not the relays').
    reading: list[str] = field(default_factory=list)
    standing_by: list[str] = field(default_factory=list)
    failover: bool | None = None  # kept on standbys (PostgreSQL 17+); None: before 17

    @property
    def unbounded(self) -> bool:
        """No limit on the WAL the slot may hold (max_slot_wal_keep_size -1)."""
        return self.max_slot_wal_keep_size is not None and self.max_slot_wal_keep_size < 0

    @classmethod
    def of(cls, state: WalState, settings: OutboxSettings) -> WalLag:
        slot = state.slot
        if slot is None:
            return cls(settings.wal.slot, exists=False, lag_unknown="no such slot")
        lag = LagProbe(None, "the slot is lost")
        if slot.wal_status != "lost":
            lag = lag_seconds(settings)
        return cls(
            slot=slot.slot_name,
            exists=True,
            wal_status=slot.wal_status,
            active=slot.active,
            retained_bytes=slot.retained_bytes,
            unconfirmed_bytes=slot.unconfirmed_bytes,
            safe_wal_size=slot.safe_wal_size,
            max_slot_wal_keep_size=state.server.max_slot_wal_keep_size,
            confirmed_flush_lsn=slot.confirmed_flush_lsn,
            lag_seconds=lag.seconds,
            lag_unknown=lag.reason,
            reading_pids=[r.backend_pid for r in state.reading],
            standby_pids=[r.backend_pid for r in state.standing_by],
            reading=[r.describe() for r in state.reading],
            standing_by=[r.describe() for r in state.standing_by],
            failover=slot.failover,
        )


@dataclass
class LagReport:
    taken_at: datetime  # database clock
    mode: Literal["delete", "keep"]
    lanes: int
    topics: list[TopicLag] = field(default_factory=list)
    groups: list[GroupLag] = field(default_factory=list)
    relays: list[RelayInfo] = field(default_factory=list)
    kafka_error: str | None = None
    vacuum: VacuumState | None = None
    wal: WalLag | None = None  # in WAL mode, or when the slot exists
    lanes_needed: bool = True  # lanes need live owners (outbox/sources.py)

    @property
    def pending(self) -> int:
        return sum(t.pending for t in self.topics)

    @property
    def failed(self) -> int:
        return sum(t.failed for t in self.topics)

    @property
    def oldest_pending_age_seconds(self) -> float | None:
        ages = [t.oldest_pending_age_seconds for t in self.topics]
        return max((a for a in ages if a is not None), default=None)

    @property
    def live_relays(self) -> list[RelayInfo]:
        return [r for r in self.relays if r.alive]

    @property
    def unowned_lanes(self) -> list[int]:
        """Lanes no live relay owns, when lanes need owners (else none)."""
        if not self.lanes_needed:
            return []
        owned = {lane for r in self.live_relays for lane in r.lanes}
        return [lane for lane in range(self.lanes) if lane not in owned]

    @property
    def maintenance_relay(self) -> RelayInfo | None:
        """The live relay that runs the maintenance services, if one does."""
        return next((r for r in self.live_relays if r.maintenance), None)

    @property
    def consumer_lag(self) -> int | None:
        """The largest group lag; None when any group's lag is unknown."""
        lags = [g.total_lag for g in self.groups]
        if any(lag is None for lag in lags):
            return None
        return max((lag for lag in lags if lag is not None), default=0)

    @property
    def kafka_failed(self) -> bool:
        """Kafka was asked and did not answer (for the whole report or for a group)."""
        return self.kafka_error is not None or any(g.error for g in self.groups)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["taken_at"] = self.taken_at.isoformat()
        for relay in data["relays"]:
            relay["started_at"] = relay["started_at"].isoformat()
        for group, g in zip(data["groups"], self.groups, strict=True):
            group["total_lag"] = g.total_lag
        data["vacuum"] = self.vacuum.to_dict() if self.vacuum else None
        holder = self.vacuum.holder if self.vacuum else None
        leader = self.maintenance_relay
        data["totals"] = {
            "pending": self.pending,
            "failed": self.failed,
            "oldest_pending_age_seconds": self.oldest_pending_age_seconds,
            "live_relays": len(self.live_relays),
            "maintenance_relay": leader.relay_id if leader else None,
            "unowned_lanes": len(self.unowned_lanes),
            "max_consumer_lag": self.consumer_lag,
            "outbox_dead_rows": self.vacuum.dead_rows if self.vacuum else None,
            "oldest_snapshot_seconds": holder.seconds if holder else None,
            "wal_lag_seconds": self.wal.lag_seconds if self.wal else None,
            "wal_retained_bytes": self.wal.retained_bytes if self.wal else None,
        }
        return data


@dataclass(frozen=True)
class Thresholds:
    """Limits for probe use; a None limit is not checked."""

    max_age_seconds: float | None = None
    max_pending: int | None = None
    max_consumer_lag: int | None = None
    max_wal_bytes: int | None = None

    def breaches(self, report: LagReport) -> list[str]:
        found = []
        age = report.oldest_pending_age_seconds
        if self.max_age_seconds is not None and age is not None and age > self.max_age_seconds:
            found.append(f"oldest pending event is {age:.1f}s old (limit {self.max_age_seconds}s)")
        if report.wal is not None:
            found += self._wal_breaches(report.wal)
        if self.max_pending is not None and report.pending > self.max_pending:
            found.append(f"{counted(report.pending, 'event')} pending (limit {self.max_pending})")
        if self.max_consumer_lag is not None:
            for g in report.groups:
                lag = g.total_lag
                if lag is None:
                    found.append(
                        f"consumer group {g.group}: lag unknown (limit {self.max_consumer_lag})"
                    )
                elif lag > self.max_consumer_lag:
                    found.append(
                        f"consumer group {g.group} lags {counted(lag, 'record')} "
                        f"(limit {self.max_consumer_lag})"
                    )
        return found

    def _wal_breaches(self, wal: WalLag) -> list[str]:
        """The slot's lag against --max-age, its retained WAL against --max-wal-bytes; a
        figure that could not be measured under a limit is a breach, never a pass."""
        found = []
        limit = self.max_age_seconds
        if limit is not None:
            if wal.lag_seconds is None:
                found.append(f"WAL slot {wal.slot}: lag unknown ({wal.lag_unknown})")
            elif wal.lag_seconds > limit:
                found.append(
                    f"WAL slot {wal.slot}: oldest unconfirmed transaction is "
                    f"{wal.lag_seconds:.1f}s old (limit {limit}s)"
                )
        if self.max_wal_bytes is not None:
            if wal.retained_bytes is None:
                found.append(f"WAL slot {wal.slot}: retained WAL unknown (missing or lost)")
            elif wal.retained_bytes > self.max_wal_bytes:
                found.append(
                    f"WAL slot {wal.slot} retains {wal.retained_bytes} bytes of WAL "
                    f"(limit {self.max_wal_bytes})"
                )
        return found


class RateTracker:
    """Samples of each topic's summed Kafka end offsets, kept for ``RATE_WINDOW_SECONDS``.

    One tracker lives across the refreshes of ``outbox lag --watch``, so the rate there
    covers up to the last minute.
    """

    def __init__(self) -> None:
        self._samples: deque[tuple[float, dict[str, int]]] = deque()

    def add(self, totals: dict[str, int], at: float | None = None) -> None:
        now = time.monotonic() if at is None else at
        self._samples.append((now, totals))
        while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_SECONDS:
            self._samples.popleft()

    @property
    def has_samples(self) -> bool:
        return bool(self._samples)

    @property
    def topics(self) -> set[str]:
        return {t for _, totals in self._samples for t in totals}

    def rate(self, topic: str) -> tuple[float, float] | None:
        """(records per second, seconds covered) for ``topic``, or None without two samples."""
        having = [(at, totals[topic]) for at, totals in self._samples if topic in totals]
        if len(having) < 2:
            return None
        (t0, v0), (t1, v1) = having[0], having[-1]
        if t1 <= t0:
            return None
        return max(0, v1 - v0) / (t1 - t0), t1 - t0


def _end_totals(offsets: dict[TopicPartition, int]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for tp, end in offsets.items():
        totals[tp.topic] = totals.get(tp.topic, 0) + end
    return totals


async def _database_part(
    conn: AsyncConnection,
    settings: OutboxSettings,
    store: OpsStore,
    report: LagReport,
    stale_after: float,
    discover_groups: bool,
) -> tuple[dict[str, TopicLag], list[str], dict[str, Any]]:
    """Outbox topics, relays (into ``report``), consumer names and dead-letter counts."""
    topics: dict[str, TopicLag] = {}

    def topic(name: str) -> TopicLag:
        return topics.setdefault(name, TopicLag(name))

    for row in await conn.execute(store.pending_by_topic):
        t = topic(row.topic)
        t.pending, t.due = int(row.pending), int(row.due)
        t.oldest_pending_age_seconds = None if row.oldest_age is None else float(row.oldest_age)
    for row in await conn.execute(store.failed_by_topic):
        topic(row.topic).failed = int(row.failed)
    if report.mode == "keep":
        for row in await conn.execute(store.published_last_minute):
            t = topic(row.topic)
            t.publish_rate_per_second = int(row.published) / RATE_WINDOW_SECONDS
            t.rate_source = "db:published_at/60s"
    for row in await conn.execute(store.relays):
        age = float(row.heartbeat_age)
        report.relays.append(
            RelayInfo(
                relay_id=row.relay_id,
                hostname=row.hostname,
                pid=row.pid,
                started_at=row.started_at,
                heartbeat_age_seconds=age,
                lanes=sorted(row.lanes or []),
                alive=age <= stale_after,
                source=row.source,
                maintenance=bool(row.maintenance),
            )
        )
    report.vacuum = await vacuum_state(conn, store)
    state = await conn.run_sync(lambda sync: read_state(sync, settings))
    kind = source_of(settings)
    running = deployed(kind, (r.source for r in report.relays if r.alive))
    report.lanes_needed = running.needs_table_relays(sum(t.pending for t in topics.values()))
    if kind.reports_slot(state.slot is not None):
        # The probe opens a connection of its own (a temporary slot, dropped at once).
        report.wal = await asyncio.to_thread(WalLag.of, state, settings)
    consumers: list[str] = []
    if discover_groups:
        consumers = list((await conn.execute(store.consumer_names)).scalars())
    dead = {row.consumer: row for row in await conn.execute(store.dead_letters_by_consumer)}
    return topics, consumers, dead


async def collect(
    engine: AsyncEngine,
    settings: OutboxSettings,
    *,
    groups: Sequence[str] = (),
    discover_groups: bool = True,
    topics: Iterable[str] = (),
    stale_after: float | None = None,
    kafka: bool = True,
    rates: RateTracker | None = None,
    rate_sample_seconds: float = 0.0,
    members: bool = False,
) -> LagReport:
    """Take one lag snapshot; Kafka trouble is reported in ``kafka_error``, not raised.
    ``members``: also ask Kafka for each group's state and members (``described``)."""
    store = OpsStore(build_tables(settings))
    stale_after = default_stale_after(settings) if stale_after is None else stale_after
    with translated_errors():
        async with engine.connect() as conn:
            taken_at: datetime = (await conn.execute(store.db_now())).scalar_one()
            report = LagReport(
                taken_at=taken_at,
                mode="keep" if settings.relay.keep_published_hours > 0 else "delete",
                lanes=settings.lanes,
            )
            by_topic, consumers, dead = await _database_part(
                conn, settings, store, report, stale_after, discover_groups
            )
    for name in topics:
        by_topic.setdefault(name, TopicLag(name))
    group_names = sorted(set(groups) | set(consumers) | set(dead))
    report.groups = [GroupLag(name, measured=False) for name in group_names]
    for g in report.groups:
        row = dead.get(g.group)
        if row is not None:
            g.dead_letters = int(row.total)
            g.dead_letters_not_replayed = int(row.not_replayed)
            g.dead_letters_still_dead = int(row.still_dead)
            g.dead_letters_last_hour = int(row.last_hour)
    if kafka:
        if rates is not None and report.mode == "delete":
            for name in rates.topics:
                by_topic.setdefault(name, TopicLag(name))
        try:
            await _kafka_part(settings, report, by_topic, rates, rate_sample_seconds, members)
        except OutboxError as exc:
            report.kafka_error = str(exc)
    report.topics = sorted(by_topic.values(), key=lambda t: t.topic)
    return report


async def _kafka_part(
    settings: OutboxSettings,
    report: LagReport,
    by_topic: dict[str, TopicLag],
    rates: RateTracker | None,
    rate_sample_seconds: float,
    members: bool,
) -> None:
    async with KafkaProbe(settings) as probe:
        counts = await probe.partitions(by_topic)
        for name, n in counts.items():
            by_topic[name].partitions = n
            by_topic[name].exists = n is not None
        if rates is not None and report.mode == "delete":
            tps = [TopicPartition(t, p) for t, n in counts.items() if n for p in range(n)]
            if not rates.has_samples and rate_sample_seconds > 0:
                rates.add(_end_totals(await probe.end_offsets(tps)))
                await asyncio.sleep(rate_sample_seconds)
            rates.add(_end_totals(await probe.end_offsets(tps)))
            for name, t in by_topic.items():
                measured = rates.rate(name)
                if measured is not None:
                    t.publish_rate_per_second = measured[0]
                    t.rate_source = f"kafka:end_offsets/{measured[1]:.0f}s"
        for g in report.groups:
            try:
                g.partitions = await _group_lag(probe, g.group)
                g.measured = True
                if members:
                    g.described = GroupState.of(await probe.describe_group(g.group))
            except OutboxError as exc:
                g.error = str(exc)


async def _group_lag(probe: KafkaProbe, group: str) -> list[PartitionLag]:
    committed = await probe.committed(group)
    counts = await probe.partitions({tp.topic for tp in committed})
    tps = [TopicPartition(t, p) for t, n in counts.items() if n for p in range(n)]
    ends = await probe.end_offsets(tps)
    never = [tp for tp in tps if tp not in committed]
    starts = await probe.beginning_offsets(never)
    lags = []
    for tp in sorted(tps):
        end = ends.get(tp, 0)
        done = committed.get(tp)
        base = done if done is not None else starts.get(tp, 0)
        lags.append(PartitionLag(tp.topic, tp.partition, end, done, max(0, end - base)))
    return lags
