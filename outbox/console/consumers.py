"""The consumers' section: each group as Kafka describes it (its state, its running members
and their partitions), its lag per partition, and what it did over the last hour (events
per second and handler time per event, per minute, from ``consumer_stats``) as sparklines.

Kafka does not say since when a member is there: the console says since when *it* has
seen it (its sampler looks every ``console.sample_seconds``), and "at least since" for a
member that was there when the console started.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass

from outbox.console.charts import Point, Sparkline, sparkline
from outbox.console.sampler import WINDOW_SECONDS, Sampler
from outbox.ops.consumers import Activity, Minute
from outbox.ops.lag import GroupLag, PartitionLag


@dataclass(frozen=True)
class MemberView:
    client_id: str
    host: str
    partitions: str  # "orders[0,1] payments[3]"
    since: str


@dataclass(frozen=True)
class GroupView:
    name: str
    state: str | None  # Kafka's group state; None when Kafka did not answer
    members: tuple[MemberView, ...]
    lag: int | None
    partitions: tuple[PartitionLag, ...]
    throughput: Sparkline
    processing: Sparkline
    still_dead: int
    dead_letters: int
    error: str | None

    @property
    def running(self) -> bool | None:
        """Whether any member runs (None: Kafka did not say)."""
        return None if self.state is None else bool(self.members)


def _partitions(assigned: Sequence[tuple[str, int]]) -> str:
    by_topic: dict[str, list[int]] = {}
    for topic, partition in assigned:
        by_topic.setdefault(topic, []).append(partition)
    return " ".join(f"{t}[{','.join(map(str, ps))}]" for t, ps in sorted(by_topic.items()))


def _since(sampler: Sampler, group: str, member_id: str) -> str:
    seen = sampler.seen(group, member_id)
    if seen is None:
        return "just now"
    when = dt.datetime.fromtimestamp(seen.since, dt.UTC).strftime("%H:%M:%S UTC")
    return f"at least since {when} (this console's start)" if seen.already else f"since {when}"


def _series(
    minutes: Sequence[Minute], end: float, value: str, missing: float | None
) -> list[Point]:
    """One point per minute of the window (the minute's end, or now for the current one);
    a minute without a row is ``missing``."""
    by_minute = {int(m.at.timestamp()) // 60: m for m in minutes}
    last = int(end) // 60
    points: list[Point] = []
    for minute in range(last - int(WINDOW_SECONDS) // 60 + 1, last + 1):
        row = by_minute.get(minute)
        at = min(end, minute * 60 + 60.0)
        if row is None:
            points.append((at, missing))
        elif value == "rate":
            points.append((at, row.per_second))
        else:
            points.append((at, row.ms_per_event))
    return points


def groups(
    report_groups: Sequence[GroupLag], activity: Activity, sampler: Sampler
) -> list[GroupView]:
    end = activity.now.timestamp()
    start = end - WINDOW_SECONDS
    views = []
    for g in report_groups:
        minutes = activity.minutes.get(g.group, [])
        described = g.described
        views.append(
            GroupView(
                name=g.group,
                state=described.state if described else None,
                members=tuple(
                    MemberView(
                        m.client_id,
                        m.host,
                        _partitions(m.partitions) or "none assigned",
                        _since(sampler, g.group, m.member_id),
                    )
                    for m in (described.members if described else ())
                ),
                lag=g.total_lag,
                partitions=tuple(g.partitions),
                throughput=sparkline(
                    _series(minutes, end, "rate", 0.0), start=start, end=end, unit="events/s"
                ),
                processing=sparkline(
                    _series(minutes, end, "ms", None), start=start, end=end, unit="ms/event"
                ),
                still_dead=g.dead_letters_still_dead,
                dead_letters=g.dead_letters,
                error=g.error,
            )
        )
    return views
