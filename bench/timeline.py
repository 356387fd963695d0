"""Where a consumer's *wall* time goes (bench instrumentation, not a profiler).

A CPU profile (``bench/cpuprofile.py``) says what the consumer spends its CPU on; when the
consumer's CPU is far from a full core, the rest of the wall time is waiting, and this
says for what. :class:`Timeline` wraps a few of the consumer's awaitables with
timestamps (the fetch, the connection take, the claim round trip, the batch handler's
call, the commit, a whole transaction, the marker writes), samples the lanes' queues
every few milliseconds, and at the end prints per stage: calls, mean wall time, and how
many were in flight on average (total wall / window: 8 lanes each in a transaction all
the time is 8.0). Next to it: the process's own CPU share and the time it waited for a
core (``/proc/self/schedstat``), and every process's CPU grouped (PostgreSQL, the
broker, this process, others), so a saturated machine is told from a waiting consumer.

The wrapped names exist in every version of the consumer since issue 34's batch
handlers; a name a version lacks is skipped (its stage is then missing from the report).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

Interval = tuple[float, float]


def _schedstat() -> tuple[float, float] | None:
    """(seconds on a CPU, seconds runnable but waiting for one) of this process's
    threads so far (the main thread is the event loop)."""
    try:
        with open(f"/proc/{os.getpid()}/schedstat") as f:
            run, wait, _ = f.read().split()
    except OSError:
        return None
    return int(run) / 1e9, int(wait) / 1e9


def _process_ticks() -> dict[int, tuple[str, int]]:
    """CPU clock ticks so far of every process, with its group: this process, postgres,
    java (the broker), python (other Python processes: producers, other sessions'
    benches), other."""
    me = os.getpid()
    ticks: dict[int, tuple[str, int]] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        used = int(fields[11]) + int(fields[12])  # utime + stime
        if int(pid) == me:
            group = "this process (consumer)"
        elif comm.startswith("postgres"):
            group = "postgres"
        elif comm == "java":
            group = "broker (java)"
        elif comm.startswith(("python", "outbox")):
            group = "other python"
        else:
            group = "other"
        ticks[int(pid)] = (group, used)
    return ticks


def _groups_used(
    before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]
) -> dict[str, int]:
    """Ticks used between two :func:`_process_ticks` by group (a process that ended
    meanwhile is not counted; one that started counts from zero)."""
    groups: collections.Counter[str] = collections.Counter()
    for pid, (group, used) in after.items():
        groups[group] += used - before.get(pid, (group, 0))[1]
    return dict(groups)


class Timeline:
    def __init__(self) -> None:
        self.intervals: dict[str, list[Interval]] = collections.defaultdict(list)
        self.fetched: list[tuple[int, int]] = []  # (records, partitions) per getmany
        self.requested: list[int] = []  # partitions asked for per fetch request
        # (when, queued events, paused partitions, busy lanes) samples
        self.queued: list[tuple[float, int, int, int]] = []
        self._undo: list[Callable[[], None]] = []
        self.window: Interval | None = None
        Mark = tuple[float, tuple[float, float] | None, dict[int, tuple[str, int]]]
        self._started: Mark | None = None
        self._result: Mark | None = None
        self._sampler: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ wrapping

    def _wrap(
        self, owner: Any, name: str, stage: str, note: Callable[[Any], None] | None = None
    ) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return
        intervals = self.intervals[stage]

        @functools.wraps(original)
        async def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                result = await original(*args, **kwargs)
            finally:
                intervals.append((t0, time.perf_counter()))
            if note is not None:
                note(result)
            return result

        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, original))

    def install(self) -> None:
        from aiokafka import AIOKafkaConsumer

        import inbox.processor as processor
        import inbox.together as together
        import inbox.transaction as transaction
        from inbox.app import Handler
        from inbox.connections import Connections
        from inbox.dispatch import Dispatch
        from inbox.marker import AttemptMarker
        from inbox.store import InboxStore

        def fetched(batches: Any) -> None:
            self.fetched.append((sum(len(r) for r in batches.values()), len(batches)))

        self._wrap(AIOKafkaConsumer, "getmany", "fetch (getmany)", fetched)
        from aiokafka.consumer.fetcher import Fetcher

        original = Fetcher._proc_fetch_request
        requests = self.intervals["  aiokafka fetch request (round trip)"]
        sizes = self.requested

        async def timed_request(fetcher: Any, assignment: Any, node_id: Any, request: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await original(fetcher, assignment, node_id, request)
            finally:
                requests.append((t0, time.perf_counter()))
                sizes.append(sum(len(parts) for _, parts in request.topics))

        Fetcher._proc_fetch_request = timed_request
        self._undo.append(lambda: setattr(Fetcher, "_proc_fetch_request", original))
        # Wrapped where it is called (each module holds its own name for it).
        self._wrap(processor, "transaction", "transaction (take .. give back)")
        self._wrap(together, "transaction", "transaction (take .. give back)")
        self._wrap(Connections, "take", "  connection take")
        self._wrap(InboxStore, "begin_and_claim", "  BEGIN + claim (round trip)")
        self._wrap(Dispatch, "run_batch", "  batch handler: parse + call")
        self._wrap(Handler, "call_batch", "    the handler's INSERT")
        self._wrap(transaction, "_commit", "  flush + COMMIT")
        self._wrap(AttemptMarker, "mark", "marker written alone")
        self._wrap(together, "process_together", "shared transaction (sharer)")
        self._wrap(processor.PartitionProcessor, "process", "lane's own task run")

    def uninstall(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    @contextmanager
    def installed(self) -> Iterator[Timeline]:
        self.install()
        try:
            yield self
        finally:
            self.uninstall()

    # ------------------------------------------------------------------ window

    def start(self, daemon: Any) -> None:
        self._started = (time.perf_counter(), _schedstat(), _process_ticks())
        self._sampler = asyncio.create_task(self._sample(daemon))

    def stop(self) -> None:
        self._result = (time.perf_counter(), _schedstat(), _process_ticks())
        if self._sampler is not None:
            self._sampler.cancel()

    async def _sample(self, daemon: Any) -> None:
        while True:
            lanes = list(getattr(daemon, "_lanes", {}).values())
            self.queued.append(
                (
                    time.perf_counter(),
                    sum(len(lane.events) for lane in lanes),
                    sum(1 for lane in lanes if lane.paused),
                    sum(1 for lane in lanes if lane.busy),
                )
            )
            await asyncio.sleep(0.005)

    # ------------------------------------------------------------------ report

    def report(self, events: int) -> str:
        assert self._started is not None and self._result is not None
        t0, sched0, ticks0 = self._started
        t1, sched1, ticks1 = self._result
        window = t1 - t0
        lines = [f"wall-time timeline of {window:.2f} s, {events:,} events:"]
        lines.append(
            "  stage                               calls   mean ms  in flight (avg)  "
            "share of window with >=1"
        )
        for stage, all_intervals in self.intervals.items():
            ivs = [(max(a, t0), min(b, t1)) for a, b in all_intervals if b > t0 and a < t1]
            if not ivs:
                continue
            total = sum(b - a for a, b in ivs)
            lines.append(
                f"  {stage:35} {len(ivs):6,} {1000 * total / len(ivs):9.2f} "
                f"{total / window:15.2f}  {100 * _union(ivs) / window:6.0f}%"
            )
        if self.fetched:
            records = [r for r, _ in self.fetched]
            empty = sum(1 for r in records if r == 0)
            full = [r for r in records if r]
            parts = [p for r, p in self.fetched if r]
            lines.append(
                f"  fetches: {len(records):,} getmany calls, {empty} empty; records per "
                f"non-empty call: mean {sum(full) / max(len(full), 1):,.0f}, max "
                f"{max(full, default=0):,}; partitions per call mean "
                f"{sum(parts) / max(len(parts), 1):.1f}"
            )
        if self.requested:
            lines.append(
                f"  fetch requests: {len(self.requested):,}, partitions asked for per request: "
                f"mean {sum(self.requested) / len(self.requested):.1f}"
            )
        if len(self.queued) > 1:
            # Weighted by the time until the next sample: a busy event loop samples late.
            spans = [(b[0] - a[0], a[1:]) for a, b in itertools.pairwise(self.queued)]
            total = sum(w for w, _ in spans) or 1.0
            dry = sum((w for w, (q, _, _) in spans if q == 0), 0.0)
            lines.append(
                "  lanes (sampled every 5 ms, time-weighted): events not finished mean "
                f"{sum(w * q for w, (q, _, _) in spans) / total:,.0f}, "
                f"none at all {100 * dry / total:.0f}% of the time, "
                f"paused partitions mean {sum(w * p for w, (_, p, _) in spans) / total:.1f}, "
                f"busy lanes mean {sum(w * b for w, (_, _, b) in spans) / total:.1f}"
            )
        if sched0 is not None and sched1 is not None:
            run, wait = sched1[0] - sched0[0], sched1[1] - sched0[1]
            lines.append(
                f"  this process: on a CPU {100 * run / window:.0f}% of the window, runnable "
                f"but waiting for a CPU {100 * wait / window:.0f}%, so waiting for I/O "
                f"(idle event loop) {100 * max(window - run - wait, 0) / window:.0f}%"
            )
        hz = os.sysconf("SC_CLK_TCK")
        cpus = os.cpu_count() or 1
        used = {g: t / hz for g, t in _groups_used(ticks0, ticks1).items()}
        parts_text = ", ".join(
            f"{g} {s / window:.2f} ({1e6 * s / max(events, 1):.0f} us/event)"
            for g, s in sorted(used.items(), key=lambda kv: -kv[1])
            if s > 0
        )
        lines.append(
            f"  CPUs used over the window (of {cpus}): {sum(used.values()) / window:.2f} in all: "
            + parts_text
        )
        return "\n".join(lines)


def _union(intervals: list[Interval]) -> float:
    """Total time covered by at least one of ``intervals``."""
    covered, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        covered += b - max(a, end)
        end = b
    return covered
