"""A CPU-time sampling profiler for the benches (standard library only).

``setitimer(ITIMER_PROF)`` sends the process SIGPROF after every ``interval`` of CPU it
used (user + system), so a sample stands for CPU actually spent: time waiting for the
network, or for a core on a busy machine, takes no samples. (Wall-clock samplers count a
runnable-but-preempted process as busy, which on a shared 2-core machine puts most
samples on whatever syscall woke another process.) The kernel checks the timer once per
scheduler tick, so there are at most HZ samples per CPU second whatever ``interval`` says:
shares are what a sample measures, and the CPU microseconds per event shown are those
shares of the CPU the process really used in the window (``getrusage``). The handler
records the stack at the next bytecode boundary, so time in a C call (a socket write,
libpq) is charged to the Python function that made it; code running in a greenlet
(SQLAlchemy's async bridge) is stitched under the frame that switched into it.

    with CpuProfile() as prof:
        ...
    prof.report(events=n)                 # top functions, inclusive and own
    prof.save("out.collapsed")            # folded stacks (flamegraph.pl, speedscope)
"""

from __future__ import annotations

import collections
import os
import resource
import signal
import sys
from collections.abc import Sequence
from types import FrameType, TracebackType

Frame = tuple[str, str]  # (file, function)
# (name, qualified function names): a sample belongs to the first stage its stack holds.
Stage = tuple[str, frozenset[str]]

# Shown by package in the summary: the first of these path parts found in a frame's file.
AREAS = (
    "sqlalchemy",
    "psycopg",
    "aiokafka",
    "asyncio",
    "uvloop",
    "pydantic",
    "prometheus_client",
    "greenlet",
    "inbox",
    "outbox",
    "bench",
)


class CpuProfile:
    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.stacks: collections.Counter[tuple[Frame, ...]] = collections.Counter()
        self._previous: object = None
        self.cpu_seconds = 0.0

    def __enter__(self) -> CpuProfile:
        self._previous = signal.signal(signal.SIGPROF, self._sample)
        self.cpu_seconds = -_cpu()
        signal.setitimer(signal.ITIMER_PROF, self.interval, self.interval)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        self.cpu_seconds += _cpu()
        signal.signal(signal.SIGPROF, self._previous)  # type: ignore[arg-type]

    def _sample(self, signum: int, frame: FrameType | None) -> None:
        stack: list[Frame] = []
        _walk(frame, stack)
        greenlet = sys.modules.get("greenlet")
        if greenlet is not None:
            current = greenlet.getcurrent()
            while current.parent is not None:
                current = current.parent
                _walk(current.gr_frame, stack)
        self.stacks[tuple(reversed(stack))] += 1

    @property
    def samples(self) -> int:
        return sum(self.stacks.values())

    def save(self, path: str) -> None:
        with open(path, "w") as out:
            for stack, n in self.stacks.items():
                out.write(";".join(f"{func} ({_short(file)})" for file, func in stack))
                out.write(f" {n}\n")

    def report(
        self, events: int, rows: int = 25, stages: Sequence[Stage] = (), per: int = 0
    ) -> str:
        """Top functions by inclusive and by own samples, and own samples by package, as
        shares of all samples and as CPU microseconds per event; with ``stages``, every
        sample also goes to the first stage whose functions its stack holds (and ``per``
        events per transaction adds a column of microseconds per transaction)."""
        total = self.samples or 1
        inclusive: collections.Counter[Frame] = collections.Counter()
        own: collections.Counter[Frame] = collections.Counter()
        areas: collections.Counter[str] = collections.Counter()
        for stack, n in self.stacks.items():
            for frame in set(stack):
                inclusive[frame] += n
            if stack:
                own[stack[-1]] += n
                areas[_area(stack[-1][0])] += n
        per_event = self.cpu_seconds * 1e6 / max(events, 1) / total
        lines = [f"{total} samples, {per_event * total:.0f} us CPU per event in the window"]
        for title, counter in (("inclusive", inclusive), ("own", own)):
            lines.append(f"  {title}:")
            for (file, func), n in counter.most_common(rows):
                share, cost = 100 * n / total, n * per_event
                lines.append(f"    {share:5.1f}% {cost:6.1f} us/event  {func} ({_short(file)})")
        lines.append(
            "  own, by package: "
            + ", ".join(f"{area} {100 * n / total:.0f}%" for area, n in areas.most_common())
        )
        if stages:
            lines.append("  by stage:")
            for name, n in self.by_stage(stages).most_common():
                share, cost = 100 * n / total, n * per_event
                txn = f" {cost * per:7.0f} us/txn" if per else ""
                lines.append(f"    {share:5.1f}% {cost:6.1f} us/event{txn}  {name}")
        return "\n".join(lines)

    def by_stage(self, stages: Sequence[Stage]) -> collections.Counter[str]:
        counts: collections.Counter[str] = collections.Counter()
        for stack, n in self.stacks.items():
            names = {func for _, func in stack}
            stage = next((name for name, funcs in stages if names & funcs), "other")
            counts[stage] += n
        return counts


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _walk(frame: FrameType | None, into: list[Frame]) -> None:
    while frame is not None:
        code = frame.f_code
        into.append((code.co_filename, code.co_qualname))
        frame = frame.f_back


def _short(file: str) -> str:
    for marker in ("site-packages/", "lib/python3"):
        if marker in file:
            return file.split(marker, 1)[1]
    return os.path.relpath(file) if os.path.isabs(file) else file


def _area(file: str) -> str:
    parts = file.replace("\\", "/").split("/")
    for area in AREAS:
        if area in parts:
            return area
    if file.startswith("<"):
        return "generated"
    return "stdlib" if file.startswith(sys.prefix) or "lib/python3" in file else "other"
