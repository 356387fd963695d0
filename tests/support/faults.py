"""One sick broker under a steady stream: the harness of the broker-fault tests.

One ``outbox relay`` and one ``outbox consume`` from the CLI, all brokers as bootstrap, a
stream of events over 40 keys committed by a thread while a fault runs (:func:`run_fault`).
Counted as everywhere: lost events, duplicate effects, out-of-order pairs per key. Every
event's way is timed in two parts, both on this host's wall clock:

* *relay*: the producer's commit -> the broker's append (the topic's ``LogAppendTime``,
  read back from Kafka after the run; the first copy when the relay sent one twice);
* *consumer*: that append -> the handler's commit (the database's clock);

per class of partition: *clear* of the sick brokers (no replica there: nothing in Kafka
stops them), *led* by one, or *followed* (a replica there: with ``acks=all`` no write
completes until Kafka takes it out of the in-sync replicas). The report gives each class's
worst, split, in 2-s buckets of commit time, the victim's roles (leader of how many
partitions, the group's coordinator, leader of offsets partitions, the active
controller), and what the consumer did with its group during the fault: its own lines
(partitions assigned / released) and aiokafka's group coordinator's (coordinator lookups,
joins, heartbeat failures), which the test app writes to a file of its own
(``INBOX_TEST_GROUP_LOG``, tests/support/inbox_apps.py).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka.partitioner import murmur2
from sqlalchemy import Engine, text

from outbox import Message, Outbox
from outbox.settings import OutboxSettings
from tests.support.cluster import FailoverWatch, KafkaCluster, PartitionInfo, busiest_leader
from tests.support.inbox import effects_table, subprocess_env
from tests.support.kafka import read_until
from tests.support.relay import RelayProcess, publish_numbered, relay_env
from tests.support.wal import wal_env

KEYS = 40
PARTITIONS = 12
TIMELY = 2.0
# The stream's first seconds are not judged: it starts at full rate on daemons that sat idle
# after the warm-up events, and on the loaded CI host (4 brokers and 3 controllers on 2
# cores, load 11-13) their latency climbed to 2.2 s and fell to 0.5 s within 4 s, every run,
# before any fault (the clear partitions then stayed at 0.2-0.6 s through the fault). The
# report prints that figure; the verdict starts after it, still 3 s before the fault.
RAMP = 3.0
TARGET = "tests.support.inbox_apps:app"
ROOT = Path(__file__).resolve().parents[2]
DUMPS = bool(os.environ.get("OUTBOX_TEST_TASK_DUMPS"))  # see Daemons.dump_tasks
# OUTBOX_TEST_FAULT_MATRIX=1: every combination the fault tests know (hours of cluster time
# on this host); by default CI runs the cases that cover each behaviour once.
MATRIX = bool(os.environ.get("OUTBOX_TEST_FAULT_MATRIX"))


@dataclass(frozen=True)
class Load:
    """A steady stream: ``rate`` events/s committed ``per_tx`` to a transaction."""

    rate: float
    per_tx: int


GENTLE = Load(40, 2)  # each key once a second
BUSY = Load(200, 5)  # what issue 52 ran: 200 events/s over the 40 keys


# ------------------------------------------------------------------------------ the stream


class Stream:
    """Commits ``load`` on a thread, keys k0..k39 in turn, paced against its start (a slow
    commit does not lower the rate); remembers each event's commit time."""

    def __init__(
        self, engine: Engine, settings: OutboxSettings, topic: str, start: int, load: Load
    ) -> None:
        self._engine, self._settings, self._topic = engine, settings, topic
        self._start, self._load = start, load
        self.committed: dict[str, float] = {}
        self.seconds = 0.0  # how long it ran
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        # One connection and one Outbox for the whole stream: publish_numbered's own
        # (a pool checkout and an Outbox per call) cost twice the CPU, and on a loaded
        # host the stream fell to a quarter of its rate.
        per_tx, rate = self._load.per_tx, self._load.rate
        outbox = Outbox(self._settings)
        begin, n = time.monotonic(), 0
        try:
            with self._engine.connect() as conn:
                while not self._stop.is_set():
                    numbers = range(self._start + n, self._start + n + per_tx)
                    with conn.begin():
                        ids = outbox.publish_many(conn, [_message(self._topic, i) for i in numbers])
                    self.committed.update(dict.fromkeys(map(str, ids), time.time()))
                    n += per_tx
                    self._stop.wait(max(0.0, begin + n / rate - time.monotonic()))
        except BaseException as exc:  # surfaced by the test
            self.error = exc
        self.seconds = time.monotonic() - begin

    def __enter__(self) -> Stream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def _message(topic: str, n: int) -> Message:
    """Event ``n`` of the stream (publish_numbered's shape: key k{n % KEYS}, seq n)."""
    key = f"k{n % KEYS}"
    return Message(topic=topic, key=key, event_type="test.event", payload={"key": key, "seq": n})


# ----------------------------------------------------------------------------- the daemons


class Daemons:
    """``outbox relay`` and ``outbox consume`` as subprocesses, logs to files, the
    defaults users run (the test helpers' fast retries aside); ``consumer_env`` adds to
    the consumer's environment (a group instance id, say)."""

    def __init__(
        self,
        settings: OutboxSettings,
        topic: str,
        table: str,
        group: str,
        logs: Path,
        consumer_env: dict[str, str] | None = None,
        target: str = TARGET,
    ) -> None:
        source = wal_env(settings) if settings.source == "wal" else {}
        self.relay = RelayProcess(relay_env(settings, **source), logs, "relay")
        self.group_log = logs / "group.log"
        self.task_dumps = logs / "tasks.txt"
        env = subprocess_env(
            settings,
            INBOX_TEST_CONSUMER=group,
            INBOX_TEST_TOPIC=topic,
            INBOX_TEST_EFFECTS=table,
            INBOX_TEST_GROUP_LOG=str(self.group_log),
            INBOX_TEST_TASK_DUMPS=str(self.task_dumps),
            **(consumer_env or {}),
        )
        for name in ("OUTBOX_RETRY__BASE_SECONDS", "OUTBOX_RETRY__CAP_SECONDS"):
            env.pop(name, None)
        self.consumer_log = logs / "consumer.log"
        self._log = self.consumer_log.open("ab")
        self.consumer = subprocess.Popen(
            [str(Path(sys.executable).with_name("outbox")), "consume", target],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        self.relay_exit: int | None = None

    def alive(self) -> bool:
        return self.relay.alive() and self.consumer.poll() is None

    def cpu(self) -> tuple[float, float]:
        """CPU seconds (user + system) the relay and the consumer used so far."""
        return cpu_seconds(self.relay.pid), cpu_seconds(self.consumer.pid)

    async def dump_tasks(self, engine: Engine, every: float) -> None:
        """Until cancelled: the consumer's task stacks to ``task_dumps`` every ``every`` s,
        and the database's sessions beside them (``OUTBOX_TEST_TASK_DUMPS=1``: what a
        stalled consumer waits on)."""
        sessions = self.task_dumps.with_name("sessions.txt")
        while self.consumer.poll() is None:
            self.consumer.send_signal(signal.SIGUSR1)
            with engine.connect() as conn:
                rows = conn.execute(
                    text(
                        "SELECT pid, state, wait_event_type, wait_event,"
                        " round(extract(epoch FROM now() - xact_start)::numeric, 2),"
                        " left(query, 100) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                        " AND state <> 'idle'"
                    )
                ).all()
            with sessions.open("a") as f:
                f.write(f"=== {time.time():.3f}\n" + "".join(f"{r}\n" for r in rows))
            await asyncio.sleep(every)

    def logs(self) -> str:
        consumer = self.consumer_log.read_text(errors="replace")
        return f"relay:\n{self.relay.log()[-3000:]}\nconsumer:\n{consumer[-3000:]}"

    def stop(self) -> None:
        # SIGTERM, as an operator stops it after the fault (see run_fault: its log must
        # stay free of unread batch failures); SIGKILL after 30 s.
        if self.relay.alive():
            self.relay_exit, _ = self.relay.terminate(30)
        self.relay.kill()
        if self.consumer.poll() is None:
            self.consumer.terminate()
            try:
                self.consumer.wait(30)
            except subprocess.TimeoutExpired:
                self.consumer.kill()
                self.consumer.wait(10)
        self._log.close()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------- what happened


def partition_of(key: str) -> int:
    return (murmur2(key.encode()) & 0x7FFFFFFF) % PARTITIONS


def classify(partitions: dict[int, PartitionInfo], sick: set[int]) -> dict[int, str]:
    return {
        p: "led" if i.leader in sick else "followed" if sick & set(i.replicas) else "clear"
        for p, i in partitions.items()
    }


@dataclass
class Bucket:
    """The worst of the events committed in one 2-s bucket: end to end, and each part."""

    worst: float = 0.0
    relay: float = 0.0
    consumer: float = 0.0

    def add(self, e2e: float, relay: float, consumer: float) -> None:
        self.worst, self.relay = max(self.worst, e2e), max(self.relay, relay)
        self.consumer = max(self.consumer, consumer)


@dataclass
class Class:
    """What events of one class of partition went through."""

    events: int = 0
    worst: float = 0.0  # commit -> handler, seconds
    worst_at: float = 0.0  # commit time of the worst, relative to the fault
    worst_split: tuple[float, float] = (0.0, 0.0)  # the worst's relay and consumer parts
    relay: float = 0.0  # the worst commit -> append
    consumer: float = 0.0  # the worst append -> handler
    excess: float = 0.0  # the most an event waited beyond the moment Kafka could take it
    failover: float = 0.0  # slowest Kafka failover of the class, seconds after the fault
    timeline: dict[int, Bucket] = field(default_factory=dict)  # 2-s bucket -> worst


@dataclass
class Outcome:
    lost: int
    duplicates: int
    out_of_order: int
    baseline: float  # worst commit -> handler latency of the events handled before the fault
    classes: dict[str, Class]
    ramp: float = 0.0  # worst latency of the stream's first RAMP seconds (printed, not judged)
    victim: str = ""  # the sick brokers and their roles
    group_events: list[str] = field(default_factory=list)
    relay_events: list[str] = field(default_factory=list)
    rebalances: int = 0  # assignments the member received after the fault
    coordinator_hit: bool = False
    cpu_us: tuple[float, float] = (0.0, 0.0)  # relay, consumer: CPU per event of the stream
    rate: float = 0.0  # events/s the stream committed
    load: float = field(default_factory=lambda: os.getloadavg()[0])

    def report(self) -> str:
        lines = [
            f"victim: {self.victim}",
            f"lost {self.lost}, duplicate effects {self.duplicates}, out of order "
            f"{self.out_of_order}; the stream's first {RAMP:.0f} s (not judged): worst "
            f"{self.ramp:.2f} s; before the fault: worst {self.baseline:.2f} s; "
            f"rebalances after the fault {self.rebalances}; stream {self.rate:.0f} events/s; "
            f"load {self.load:.1f}; CPU per "
            f"event: relay {self.cpu_us[0]:.0f} us, consumer {self.cpu_us[1]:.0f} us",
        ]
        for kind, c in sorted(self.classes.items()):
            lines.append(
                f"  {kind:8s} {c.events:5d} events: worst {c.worst:5.2f} s (committed at "
                f"{c.worst_at:+.1f} s; relay {c.worst_split[0]:.2f} + consumer "
                f"{c.worst_split[1]:.2f}); worst relay part {c.relay:5.2f} s, consumer part "
                f"{c.consumer:5.2f} s; Kafka failover {c.failover:4.1f} s, worst beyond it "
                f"{c.excess:5.2f} s"
            )
            lines.append(
                "    "
                + " ".join(
                    f"{b:+d}:{v.worst:.1f}({v.relay:.1f}/{v.consumer:.1f})"
                    for b, v in sorted(c.timeline.items())
                )
            )
        lines.append("  group events (s after the fault):")
        lines.extend(f"    {e}" for e in self.group_events or ["none"])
        lines.append("  relay events (s after the fault):")
        lines.extend(f"    {e}" for e in self.relay_events or ["none"])
        return "\n".join(lines)

    def summary(self, name: str) -> str:
        """One line for the runs' table: clear worst (relay/consumer), group events."""
        clear = self.classes.get("clear")
        worst = (
            f"clear {clear.worst:.2f} s (relay {clear.relay:.2f}, consumer {clear.consumer:.2f})"
            if clear
            else "no clear partitions"
        )
        others = ", ".join(
            f"{k} beyond failover {c.excess:.2f}"
            for k, c in sorted(self.classes.items())
            if k != "clear"
        )
        return (
            f"RUN {name} | {self.victim} | {worst} | {others} | rebalances {self.rebalances} | "
            f"lost {self.lost} dup {self.duplicates} ooo {self.out_of_order} | "
            f"{self.rate:.0f} ev/s, load {self.load:.1f}"
        )

    def assert_correct(self) -> None:
        assert (self.lost, self.duplicates, self.out_of_order) == (0, 0, 0), self.report()

    def assert_timely(self, absolute: bool = False) -> None:
        """Clear partitions within 2 s throughout; the sick broker's own within 2 s of
        Kafka's failover. ``absolute``: 2 s of commit, whatever the stream's latency
        before the fault; else over that figure (the older tests' bound, for the 40
        events/s stream on a shared host). Prints the margins."""
        bound = TIMELY + (0.0 if absolute else self.baseline)
        checks = {"clear": "worst", "led": "excess", "followed": "excess"}
        margins = {
            kind: bound - getattr(self.classes[kind], what)
            for kind, what in checks.items()
            if kind in self.classes
        }
        print("margins (s): " + ", ".join(f"{k} {v:+.2f}" for k, v in margins.items()))
        assert all(m >= 0 for m in margins.values()), self.report()

    def assert_clear_timely(self) -> None:
        """Only the clear partitions: within 2 s of commit throughout (issue 52)."""
        clear = self.classes["clear"]
        print(f"clear partitions: worst {clear.worst:.2f} s (bound {TIMELY:.0f} s)")
        assert clear.worst <= TIMELY, self.report()


async def appended_at(bootstrap: str, topic: str, ids: set[str]) -> dict[str, float]:
    """Each event's first append to ``topic`` (its LogAppendTime, epoch seconds)."""
    want = set(ids)

    def all_seen(record: object) -> bool:
        want.discard(record.headers.get("ce_id", b"").decode())  # type: ignore[attr-defined]
        return not want

    first: dict[str, float] = {}
    for r in await read_until(bootstrap, topic, all_seen, 60):
        ce_id = r.headers.get("ce_id", b"").decode()
        first[ce_id] = min(first.get(ce_id, float("inf")), r.timestamp / 1000)
    return first


def outcome(
    engine: Engine,
    table: str,
    stream: Stream,
    appended: dict[str, float],
    kinds: dict[int, str],
    fault_at: float,
    recovered: dict[int, float],
    ramp_until: float = 0.0,
) -> Outcome:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                f"SELECT event_id, key, seq, extract(epoch FROM committed_at)::float8"
                f" FROM {table} ORDER BY id"
            )
        ).all()
    seen: dict[str, int] = {}
    last: dict[str, int] = {}
    out_of_order = 0
    baseline = ramp = 0.0
    classes = {kind: Class() for kind in set(kinds.values())}
    for kind, c in classes.items():
        c.failover = max(
            recovered.get(p, float("inf")) - fault_at for p in kinds if kinds[p] == kind
        )
    for event_id, key, seq, applied in rows:
        seen[event_id] = seen.get(event_id, 0) + 1
        if seen[event_id] > 1:
            continue
        if key in last and seq < last[key]:
            out_of_order += 1
        last[key] = max(seq, last.get(key, seq))
        committed = stream.committed.get(event_id)
        if committed is None:  # the events that warmed the daemons up
            continue
        lag = applied - committed
        if committed < ramp_until:  # the stream ramping up from idle: before any verdict
            ramp = max(ramp, lag)
            continue
        if applied < fault_at:  # handled before the fault: the quiet figure
            baseline = max(baseline, lag)
        append = appended.get(event_id, committed)
        # Kafka's clock has milliseconds: a part may come out a millisecond below zero.
        relay, consumer = max(append - committed, 0.0), max(applied - append, 0.0)
        partition = partition_of(key)
        c = classes[kinds[partition]]
        c.events += 1
        if lag > c.worst:
            c.worst, c.worst_at, c.worst_split = lag, committed - fault_at, (relay, consumer)
        c.relay, c.consumer = max(c.relay, relay), max(c.consumer, consumer)
        c.excess = max(c.excess, applied - max(committed, recovered.get(partition, fault_at)))
        bucket = int((committed - fault_at) // 2) * 2
        c.timeline.setdefault(bucket, Bucket()).add(lag, relay, consumer)
    return Outcome(
        lost=len(set(stream.committed) - set(seen)),
        duplicates=sum(n - 1 for n in seen.values()),
        out_of_order=out_of_order,
        baseline=baseline,
        ramp=ramp,
        classes=classes,
    )


_ISO = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z (\w+) +(\S+): (.*)$")
# The consumer's and relay's own lines worth showing beside the numbers.
_OURS = re.compile(
    r"partitions (assigned|released)|unavailable|available again|Kafka|replaced|coordinator"
    r"|rebalanc|commit"
)


def _our_lines(log: str, since: float, until: float) -> list[tuple[float, str]]:
    found = []
    for line in log.splitlines():
        m = _ISO.match(line)
        if m is None:
            continue
        when = dt.datetime.fromisoformat(m[1]).replace(tzinfo=dt.UTC).timestamp()
        if since <= when <= until and _OURS.search(m[4]):
            found.append((when, f"{m[2]} {m[4][:220]}"))
    return found


def _group_lines(path: Path, since: float, until: float) -> list[tuple[float, str]]:
    """The test app's file of aiokafka's group coordinator lines ("epoch level message")."""
    if not path.exists():
        return []
    found = []
    for line in path.read_text(errors="replace").splitlines():
        stamp, _, rest = line.partition(" ")
        try:
            when = float(stamp)
        except ValueError:
            continue
        if since <= when <= until:
            found.append((when, f"aiokafka {rest[:220]}"))
    return found


def events_of(daemons: Daemons, fault_at: float, until: float) -> tuple[list[str], list[str], int]:
    """(group events, relay events, assignments after the fault) from the daemons' logs."""
    consumer_log = daemons.consumer_log.read_text(errors="replace")
    group = sorted(
        _our_lines(consumer_log, fault_at - 1, until)
        + _group_lines(daemons.group_log, fault_at - 1, until)
    )
    relay = _our_lines(daemons.relay.log(), fault_at - 1, until)
    assigned = sum(1 for when, line in group if when >= fault_at and "partitions assigned" in line)
    return _collapsed(group, fault_at)[:60], _collapsed(relay, fault_at)[:40], assigned


def _collapsed(lines: list[tuple[float, str]], fault_at: float) -> list[str]:
    """Lines relative to the fault; a line repeated (a fetch failing every 0.1 s) once,
    with how often and until when."""
    out: list[tuple[float, str, int, float]] = []
    for when, line in lines:
        if out and out[-1][1] == line:
            first, text_, n, _ = out[-1]
            out[-1] = (first, text_, n + 1, when)
        else:
            out.append((when, line, 1, when))
    return [
        f"{first - fault_at:+6.2f} {line}"
        + (f" (x{n}, until {last - fault_at:+.2f})" if n > 1 else "")
        for first, line, n, last in out
    ]


# ------------------------------------------------------------------------------- the run


async def until_applied(engine: Engine, table: str, expected: int, daemons: Daemons) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 120
    done = 0
    while loop.time() < deadline:
        with engine.connect() as conn:
            done = conn.execute(text(f"SELECT count(DISTINCT event_id) FROM {table}")).scalar_one()
        if done >= expected:
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"{done} of {expected} events applied\n{daemons.logs()}")


async def new_topic(cluster: KafkaCluster) -> str:
    """A topic of PARTITIONS partitions stamped with the broker's append time."""
    topic = f"faults-{uuid.uuid4().hex[:8]}"
    await cluster.create_topic(
        topic, PARTITIONS, configs={"message.timestamp.type": "LogAppendTime"}
    )
    await cluster.wait_in_sync([topic])
    return topic


async def stream_setup(
    cluster: KafkaCluster, engine: Engine, settings: OutboxSettings
) -> tuple[str, OutboxSettings, str]:
    """A new topic, the settings that reach ``cluster``, a new effects table."""
    topic = await new_topic(cluster)
    s = settings.model_copy(update={"kafka_bootstrap_servers": cluster.bootstrap})
    return topic, s, effects_table(engine)


def busiest_coordinator(
    partitions: dict[int, PartitionInfo], coordinators: set[int], on_it: bool = True
) -> int:
    """The busiest leader among the brokers that are group coordinators (after an earlier
    fault a broker may lead partitions of a new topic but none of the offsets topic); with
    ``on_it`` False (the group's coordinator must stay clear), among those that leave
    another coordinator (on a fresh cluster one broker may lead the whole offsets topic)."""
    if on_it:
        candidates = {p: i for p, i in partitions.items() if i.leader in coordinators}
    else:
        candidates = {p: i for p, i in partitions.items() if coordinators - {i.leader}}
    return busiest_leader(candidates or partitions)


Fault = Callable[[KafkaCluster, list[int]], Awaitable[None]]


@dataclass(frozen=True)
class Victim:
    """How the sick broker is chosen, and where the consumer's group sits.

    ``busiest``: the broker leading the most partitions of the topic, whatever else it is
    (as users meet a fault); ``group``: "anywhere" (a random group name, where Kafka puts
    it), "on" (a group whose coordinator is the victim) or "off" (one on another broker).
    With ``busiest`` False the victim is the busiest leader among the group coordinators
    (the older tests' choice, which put the group on or off it deliberately)."""

    busiest: bool = True
    group: str = "anywhere"
    sick: int = 1  # more than one: the next busiest leaders too


async def _choose(
    cluster: KafkaCluster, partitions: dict[int, PartitionInfo], victim: Victim
) -> tuple[list[int], str | None]:
    coordinators = await cluster.coordinators()
    if victim.busiest:
        first = busiest_leader(partitions)
    else:
        first = busiest_coordinator(partitions, coordinators, victim.group != "off")
    hit = [first]
    while len(hit) < victim.sick:  # the next busiest leaders
        hit.append(busiest_leader({p: i for p, i in partitions.items() if i.leader not in hit}))
    group: str | None = f"c-{uuid.uuid4().hex[:8]}"
    if victim.group == "on":
        group = await cluster.group_on(hit[0]) if hit[0] in coordinators else None
    elif victim.group == "off":
        group = await cluster.group_on(next(b for b in sorted(coordinators) if b not in hit))
    return hit, group


async def _roles(
    cluster: KafkaCluster,
    topic: str,
    partitions: dict[int, PartitionInfo],
    hit: list[int],
    group: str,
) -> tuple[str, bool]:
    """What the sick brokers are besides leaders of the topic's partitions; whether one
    of them is the group's coordinator."""
    coordinator = await cluster.coordinator(group)
    offsets = await cluster.describe("__consumer_offsets")
    controller = cluster.active_controller(topic)
    said = []
    for b in hit:
        led = sum(1 for i in partitions.values() if i.leader == b)
        roles = [f"leads {led}/{len(partitions)}"]
        if b == coordinator:
            roles.append("group coordinator")
        if (n := sum(1 for i in offsets.values() if i.leader == b)) > 0:
            roles.append(f"leads {n} offsets partitions")
        if b == controller:
            roles.append("active controller")
        said.append(f"broker {b} ({', '.join(roles)})")
    return "; ".join(said), coordinator in hit


async def run_fault(
    cluster: KafkaCluster,
    engine: Engine,
    settings: OutboxSettings,
    logs: Path,
    fault: Fault,
    *,
    victim: Victim = Victim(),
    load: Load = GENTLE,
    consumer_env: dict[str, str] | None = None,
    target: str = TARGET,
    warm: float = 6.0,
    tail: float = 12.0,
) -> Outcome:
    """Both daemons up and caught up, the stream on, ``fault`` on the chosen victims, the
    stream on for ``tail`` s more; then every event applied, the split measured, the
    cluster healed. Checks that neither daemon exited, printed a traceback, or stopped
    otherwise than cleanly at SIGTERM."""
    topic, s, table = await stream_setup(cluster, engine, settings)
    partitions = await cluster.describe(topic)
    hit, group = await _choose(cluster, partitions, victim)
    assert group is not None, f"no group id found whose coordinator is broker {hit[0]}"
    kinds = classify(partitions, set(hit))
    roles, coordinator_hit = await _roles(cluster, topic, partitions, hit, group)
    daemons = Daemons(s, topic, table, group, logs, consumer_env, target)
    try:
        # Both daemons up and connected before the clock starts.
        ready = publish_numbered(engine, s, topic, KEYS, keys=KEYS, event_type="test.event")
        await until_applied(engine, table, len(ready), daemons)
        cpu_before = daemons.cpu()
        with Stream(engine, s, topic, start=len(ready), load=load) as stream:
            ramp_until = time.time() + RAMP
            await asyncio.sleep(warm)
            fault_at = time.time()
            dumping = asyncio.create_task(daemons.dump_tasks(engine, 1.0)) if DUMPS else None
            async with FailoverWatch(cluster, topic, set(hit)) as watch:
                await fault(cluster, hit)
                await asyncio.sleep(tail)
            if dumping is not None:
                dumping.cancel()
        ended = time.time()
        assert stream.error is None, stream.error
        assert daemons.alive(), daemons.logs()
        await until_applied(engine, table, len(ready) + len(stream.committed), daemons)
        cpu = [
            (b - a) / len(stream.committed) * 1e6
            for a, b in zip(cpu_before, daemons.cpu(), strict=True)
        ]
        appended = await appended_at(cluster.bootstrap, topic, set(stream.committed))
        result = outcome(
            engine, table, stream, appended, kinds, fault_at, watch.recovered, ramp_until
        )
        result.victim, result.coordinator_hit = roles, coordinator_hit
        result.cpu_us, result.rate = (cpu[0], cpu[1]), len(stream.committed) / stream.seconds
        result.group_events, result.relay_events, result.rebalances = events_of(
            daemons, fault_at, ended
        )
    finally:
        daemons.stop()
        for node in hit:  # leave the cluster whole, and balanced, for the next test
            await asyncio.to_thread(cluster.heal, node)
        await cluster.wait_in_sync([topic])
        await asyncio.to_thread(cluster.elect_preferred)
    # Neither daemon may print a traceback at SIGTERM after a fault (a relay printed "Future
    # exception was never retrieved ... ProducerClosed" for batches its retired producers
    # failed), nor exit otherwise than cleanly (issue #38).
    for log in (daemons.relay.log(), daemons.consumer_log.read_text(errors="replace")):
        assert "never retrieved" not in log and "Traceback" not in log, log[-3000:]
    assert (daemons.relay_exit, daemons.consumer.returncode) == (0, 0), daemons.logs()
    by_kind = {k: sorted(p for p, v in kinds.items() if v == k) for k in set(kinds.values())}
    print(
        f"\nbrokers hit {hit}; partitions {by_kind}; events {len(stream.committed)} at "
        f"{len(stream.committed) / stream.seconds:.0f}/s (asked {load.rate:.0f}/s); source "
        f"{settings.source}; group {group}"
    )
    print(result.report())
    return result


# ------------------------------------------------------------------------------- faults


async def crash_and_restart_8s_later(cluster: KafkaCluster, hit: list[int]) -> None:
    cluster.kill(hit[0])
    await asyncio.sleep(8)
    await asyncio.to_thread(cluster.start, hit[0])


HANG_SECONDS = 20.0


async def hang_20s(cluster: KafkaCluster, hit: list[int]) -> None:
    cluster.pause(hit[0])
    try:
        await asyncio.sleep(HANG_SECONDS)
    finally:
        cluster.resume(hit[0])
