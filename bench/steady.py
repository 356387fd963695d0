"""Latency at a steady rate through the CLI daemons, as users run them.

    python -m bench.steady                               # 1,000 events/s, 10 ms batches, 60 s
    python -m bench.steady --rate 5000 --single --producers 4
    python -m bench.steady --consumer                    # end to end through `outbox consume`
    python -m bench.steady --vs /path/to/old/outbox --pairs 3   # alternate two relay builds
    python -m bench.steady --consumer --consumer-vs base=/path/to/old/checkout --pairs 3
    python -m bench.steady --idle 30                     # also the relay's cost with no events
    python -m bench.steady --source wal --checkout base=/path/to/old/checkout  # the WAL source
    python -m bench.steady --busy 1                      # on a busy host: a CPU-bound process
    python -m bench.steady --consumer --rate 200 --stages  # the latency budget by stage

A producer (child processes, ``Outbox.publish_many`` in the caller's transaction as an
application does) commits ``--rate`` events/s over ``--keys`` keys: one transaction per
``--tick-ms`` carrying what is due (batched), or one event per transaction (``--single``,
spread over ``--producers`` processes: one client commits ~2,500 one-row transactions/s
here). ``outbox relay`` runs as a process; with ``--consumer`` so does ``outbox consume
bench.steady_app:app``, whose handler notes ``clock_timestamp()`` per event (``--handler
batch``: ``bench.steady_app:batch_app``, a batch handler noting a list in one INSERT).

Printed per run, over the last ``--window`` seconds (the start is warm-up):

* relay: producer commit returned -> the broker's append (LogAppendTime), p50/p99/max ms;
* end to end (``--consumer``): producer commit returned -> the handler's insert, p50/p99/max;
* the relay process's CPU (user + system) per event and in % of a core;
* with ``--consumer``, the consumer process's CPU per event, from the first event's commit
  until the last was handled.

Both clocks are this machine's wall clock. ``--vs`` runs this build's relay and another
build's ``outbox`` executable alternately (the consumer is always this build's), a fresh
topic each run, and prints the medians of each side. ``--consumer-vs NAME=DIR`` does the
same for the consumer: this build's ``outbox consume`` against one run with ``PYTHONPATH=DIR``
(another checkout's ``outbox`` and ``inbox`` packages, e.g. a ``git worktree`` of the commit
before), the relay being this build's. ``--checkout NAME=DIR`` runs both daemons from that
checkout (a before/after of a change touching the relay and the consumer). ``--profile``
samples the relay with py-spy (folded stacks, idle excluded) and, with ``--consumer``,
prints where the consumer's CPU went by stage (``bench/cpuprofile.py``: CPU-time samples,
from the stream's first event to its last one handled).

``--stages`` prints the latency budget by stage, p50 (p99) over the window's events:
commit -> read (the relay claimed the row, or read it from the WAL, and hands it to
Kafka), read -> append (Kafka's produce, acks included), append -> fetch (the broker
holding the fetch, the response reaching the consumer), fetch -> handler (the consumer's
lanes, its inbox claim, the handler's insert). The daemons run under
``bench/steady_stages.py``, which stamps the two points inside them; ``--vs`` builds'
relays cannot be stamped (their stage shows as commit -> append).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import pickle
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import psycopg
from sqlalchemy.engine import make_url

from bench.common import create_topic, delete_topics, relay_env
from bench.cpuprofile import CpuProfile, Stage
from bench.relay import _dsn, own_outbox, read_topic, stop_relays, wait_balanced
from bench.steady_app import DDL, TABLE
from bench.wal import wal_mode
from outbox import Outbox, migrate
from outbox.db import sync_engine
from outbox.envelope import Message
from outbox.settings import OutboxSettings, WalSettings

# --handler -> the app in bench/steady_app.py the consumer runs.
APPS = {"event": "app", "batch": "batch_app"}
PAD = 250  # JSON payload of ~300 bytes
_TICK = os.sysconf("SC_CLK_TCK")
STAGES_SCRIPT = Path(__file__).with_name("steady_stages.py")


# (name, relay executable, consumer's PYTHONPATH, relay's checkout): see main().
Build = tuple[str, str, str | None, str | None]


@dataclass
class Run:
    relay: tuple[float, float, float]  # p50, p99, max ms
    e2e: tuple[float, float, float] | None
    events: int
    cpu_us_per_event: float
    cpu_share: float  # of one core
    consumer_cpu_us_per_event: float | None = None
    # --stages: {stage: (p50, p99) ms} over the window's events stamped at every stage.
    stages: dict[str, tuple[float, float]] | None = None


def cpu_seconds(pid: int) -> float:
    """User + system CPU of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def producer(
    url: str, topic: str, rate: float, seconds: float, tick: float, keys: int, first: int,
    step: int, single: bool, source: str, slot: str, out: Connection,
) -> None:  # fmt: skip
    """Child process: commit events ``first, first + step, ...`` at ``rate``/s for
    ``seconds`` (into the outbox table or the WAL: ``source``, read from ``slot``: the
    producer emits only while it exists); send back {event_id: wall-clock time its commit
    returned}."""
    settings = OutboxSettings(
        database_url=url,  # type: ignore[arg-type]
        source=source,  # type: ignore[arg-type]
        wal=WalSettings(slot=slot),
    )
    engine = sync_engine(settings, pool_pre_ping=False)
    ob = Outbox(settings)
    committed: dict[str, float] = {}

    def message(i: int) -> Message:
        payload = {"n": i, "pad": "x" * PAD}
        return Message(topic=topic, key=f"k{i % keys}", event_type="bench.steady", payload=payload)

    begin, n = time.perf_counter(), 0
    try:
        while (elapsed := time.perf_counter() - begin) < seconds:
            due = int(elapsed * rate)
            if due > n:
                numbers = [first + step * i for i in range(n, due)]
                groups = [[i] for i in numbers] if single else [numbers]
                for group in groups:
                    with engine.begin() as conn:
                        eids = ob.publish_many(conn, [message(i) for i in group])
                    now = time.time()
                    committed.update((str(e), now) for e in eids)
                n = due
            # Single events: commit each as soon as it is due; batches: once per tick.
            wait = (n + 1) / rate - elapsed if single else tick
            time.sleep(max(0.0, min(wait, tick)))
    finally:
        engine.dispose()
    out.send(committed)
    out.close()


def produce(settings: OutboxSettings, topic: str, args: argparse.Namespace) -> dict[str, float]:
    """Run the producer processes for ``args.seconds``; every event's commit time."""
    ctx = multiprocessing.get_context("spawn")
    n = args.producers
    url = settings.database_url.get_secret_value()
    pipes, procs = [], []
    for p in range(n):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=producer,
            args=(url, topic, args.rate / n, args.seconds, args.tick_ms / 1000, args.keys, p, n,
                  args.single, settings.source, settings.wal.slot, send),
        )  # fmt: skip
        proc.start()
        pipes.append(recv)
        procs.append(proc)
    committed: dict[str, float] = {}
    for recv, proc in zip(pipes, procs, strict=True):
        committed.update(recv.recv())
        proc.join()
    return committed


# Where the consumer's CPU goes, by the qualified names of this build and older ones: a
# sample belongs to the first stage its stack holds.
CONSUMER_STAGES: list[Stage] = [
    (name, frozenset(funcs.split()))
    for name, funcs in (
        (
            "Kafka offset commits",
            "ConsumerDaemon._committer ConsumerDaemon.flush_offsets OffsetCommitter.run "
            "OffsetCommitter.flush GroupCoordinator._do_commit_offsets",
        ),
        (
            # StreamReaderProtocol and asyncio.wait callbacks: aiokafka's socket reads and
            # its fetch routine (the database driver uses neither).
            "Kafka fetch (requests, responses, records)",
            "AIOKafkaConsumer.getmany Fetcher._fetch_requests_routine "
            "Fetcher._proc_fetch_request AIOKafkaConnection._read AIOKafkaConnection.send "
            "StreamReaderProtocol.data_received _wait.<locals>._on_completion "
            "Fetcher._create_fetch_waiter.<locals>.<lambda>",
        ),
        (
            "Kafka group, metadata watch, lag",
            "GroupCoordinator._heartbeat_routine GroupCoordinator._coordination_routine "
            "ConsumerDaemon._watch_kafka ConsumerDaemon._update_lag",
        ),
        ("record decoding (InboxEvent)", "decode"),
        ("claim: BEGIN + inbox INSERT (one round trip)", "InboxStore.begin_and_claim"),
        (
            "attempt markers (own statements)",
            "InboxStore.arm_markers InboxStore.set_marker InboxStore.disarm_marker "
            "InboxStore.marker",
        ),
        (
            "handler: its INSERT through the AsyncSession (per event, or one per list)",
            "Handler.__call__ Handler.call_batch",
        ),
        (
            "COMMIT (through the session)",
            "AsyncSession.flush AsyncSession.commit AsyncSessionTransaction.__aexit__ _commit",
        ),
        (
            "session and connection set-up",
            "AsyncSession.__init__ AsyncSession.connection async_sessionmaker.__call__ "
            "AsyncSession.begin AsyncSession.close AsyncSession.__aexit__ "
            "Connections.take Connections.give",
        ),
        ("per event: dispatch, metrics, tracing", "Dispatch.run_handler"),
        ("per list: stale checks, metrics, tracing", "Dispatch.run_batch"),
        (
            "scheduling (lanes, the sharer, shared-transaction bookkeeping)",
            "_Lane.work _Lane.feed Lane.work Lane.feed ConsumerDaemon._share process_together "
            "transaction PartitionProcessor.process",
        ),
        ("fetch loop", "ConsumerDaemon._loop"),
        ("database driver wake-ups (psycopg)", "wait_async.<locals>.wakeup"),
    )
]


def profile(pid: int, args: argparse.Namespace, out: Path) -> subprocess.Popen[bytes] | None:
    """py-spy sampling the relay while the stream runs (folded stacks, idle excluded)."""
    if not args.profile:
        return None
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        print("  py-spy is not installed: the relay is not profiled", flush=True)
        return None
    return subprocess.Popen(
        [spy, "record", "--nonblocking", "-r", "200", "-f", "raw", "-o", str(out), "-p",
         str(pid), "-d", str(int(args.seconds))],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def report_consumer(path: Path, events: int) -> None:
    """Print where the consumer's CPU went (by stage, top functions) and save the folded
    stacks beside the samples."""
    prof = CpuProfile()
    saved = pickle.loads(path.read_bytes())
    prof.stacks, prof.cpu_seconds = saved["stacks"], saved["cpu_seconds"]
    prof.save(str(path.with_suffix(".folded")))
    print(f"  profile of the consumer ({path.with_suffix('.folded')}):", flush=True)
    print(prof.report(events, rows=30, stages=CONSUMER_STAGES), flush=True)


def wait_reading(settings: OutboxSettings, timeout: float = 60) -> None:
    """Until a WAL relay reads the slot: it holds the reader lock (any version)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with psycopg.connect(settings.libpq_dsn) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
                " WHERE l.locktype = 'advisory' AND l.granted"
                " AND a.datname = current_database() AND (a.application_name = 'outbox-relay-wal'"
                " OR a.application_name LIKE 'outbox-relay-wal %')"
            ).fetchone()
        if row and row[0]:
            return
        time.sleep(0.2)
    raise RuntimeError(f"no relay read the slot within {timeout} s")


def warm_up(settings: OutboxSettings, topic: str, partitions: int, timeout: float = 120) -> None:
    """One event per partition through the relay and the consumer, waited for: the measured
    stream starts once the consumer has joined its group and holds every partition (a
    consumer still starting would otherwise meet a backlog, and the window its catch-up)."""
    ob, engine = Outbox(settings), sync_engine(settings, pool_pre_ping=False)
    try:
        with engine.begin() as conn:
            ob.publish_many(
                conn,
                [
                    Message(topic=topic, key=f"warm{p}", event_type="bench.steady", payload={})
                    for p in range(partitions * 4)  # keys hash to (nearly) every partition
                ],
            )
    finally:
        engine.dispose()
    deadline = time.monotonic() + timeout
    with psycopg.connect(settings.libpq_dsn) as conn:
        while time.monotonic() < deadline:
            (n,) = conn.execute(f"SELECT count(*) FROM {TABLE}").fetchone() or (0,)
            if n >= partitions * 4:
                return
            time.sleep(0.2)
    raise RuntimeError("the consumer did not handle the warm-up events")


def handled(settings: OutboxSettings, expect: set[str], timeout: float = 60) -> dict[str, float]:
    """{event_id: wall-clock time its handler ran}, once every expected event was handled."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(settings.libpq_dsn) as conn:
        while True:
            rows = conn.execute(
                f"SELECT event_id, extract(epoch FROM handled_at)::float8 FROM {TABLE}"
            ).fetchall()
            seen = {eid: float(at) for eid, at in rows}
            if expect <= seen.keys() or time.monotonic() > deadline:
                return seen
            time.sleep(0.5)


def pct(values: list[float]) -> tuple[float, float, float]:
    values = sorted(values)
    if not values:
        return (float("nan"),) * 3
    return values[len(values) // 2], values[int(len(values) * 0.99)], values[-1]


def database_transactions(settings: OutboxSettings, dbname: str) -> int:
    with psycopg.connect(_dsn(settings, "postgres"), autocommit=True) as conn:
        row = conn.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
            (dbname,),
        ).fetchone()
    return int(row[0]) if row else 0


def idle_cost(settings: OutboxSettings, dbname: str, pid: int, seconds: float) -> None:
    """The relay's CPU and the database transactions per second with nothing to publish."""
    time.sleep(2)
    cpu0, tx0, t0 = cpu_seconds(pid), database_transactions(settings, dbname), time.monotonic()
    time.sleep(seconds)
    # PostgreSQL's statistics reach pg_stat_database up to a second late; the window is long.
    cpu1, tx1, t1 = cpu_seconds(pid), database_transactions(settings, dbname), time.monotonic()
    print(
        f"  idle relay: {100 * (cpu1 - cpu0) / (t1 - t0):.2f}% of a core, "
        f"{(tx1 - tx0) / (t1 - t0):.1f} transactions/s in its database ({seconds:.0f} s)"
    )


def one_run(
    settings: OutboxSettings,
    dbname: str,
    exe: str,
    args: argparse.Namespace,
    logs: Path,
    consumer_path: str | None = None,
    relay_path: str | None = None,
) -> Run:
    """One stream through ``exe``'s relay and, with ``--consumer``, a consumer importing
    ``outbox``/``inbox`` from ``consumer_path`` (this build when None); with ``--profile``
    the consumer runs under the CPU-time profiler (``bench/steady_profile.py``); with
    ``--stages`` both daemons run under ``bench/steady_stages.py`` (the relay only when
    ``relay_path``, the checkout ``exe`` runs from, is known)."""
    topic = asyncio.run(
        create_topic(settings, args.partitions, {"message.timestamp.type": "LogAppendTime"})
    )
    with psycopg.connect(settings.libpq_dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {TABLE}")
        conn.execute(DDL)
    env = relay_env(settings)
    tag = uuid.uuid4().hex[:6]
    relay_command = [exe]
    stamps = {d: logs / f"{d}-{tag}.stages.json" for d in ("relay", "consumer")}
    if args.stages and relay_path is not None:
        relay_command = [sys.executable, str(STAGES_SCRIPT), str(stamps["relay"])]
        env = {**env, "PYTHONPATH": relay_path}
    relay = subprocess.Popen(
        [*relay_command, "--log-level", "WARNING", "relay"],
        env=env,
        stdout=(logs / f"relay-{tag}.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    daemons = [relay]
    # A busy host: CPU-bound processes beside the daemons (the same for every build).
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        if settings.source == "wal":
            wait_reading(settings)
        else:
            wait_balanced(settings, 1)
        if args.idle:
            idle_cost(settings, dbname, relay.pid, args.idle)
        if args.consumer:
            command = [own_outbox()]
            if args.profile:
                script = Path(__file__).with_name("steady_profile.py")
                command = [sys.executable, str(script), str(logs / f"consumer-{tag}.pickle")]
            elif args.stages:
                command = [sys.executable, str(STAGES_SCRIPT), str(stamps["consumer"])]
            consumer = subprocess.Popen(
                [
                    *command,
                    "--log-level",
                    "WARNING",
                    "consume",
                    f"bench.steady_app:{APPS[args.handler]}",
                ],
                env={
                    **env,
                    # OUTBOX_CONSUMER__* from the caller's environment (tuning experiments).
                    **{k: v for k, v in os.environ.items() if k.startswith("OUTBOX_CONSUMER__")},
                    "BENCH_STEADY_TOPIC": topic,
                    "PYTHONPATH": consumer_path or str(Path.cwd()),
                },
                stdout=(logs / f"consumer-{tag}.log").open("wb"),
                stderr=subprocess.STDOUT,
            )
            daemons.append(consumer)
            warm_up(settings, topic, args.partitions)
        spy = profile(relay.pid, args, logs / f"relay-{tag}.folded")
        if args.consumer and args.profile:
            consumer.send_signal(signal.SIGUSR1)
        start_cpu = [cpu_seconds(d.pid) for d in daemons]
        committed = produce(settings, topic, args)
        cpu = cpu_seconds(relay.pid) - start_cpu[0]
        appended = dict(asyncio.run(read_topic(settings, topic, len(committed))))
        seen = handled(settings, set(committed)) if args.consumer else {}
        # Until the last event was handled: what the consumer spent on this stream.
        consumer_cpu = cpu_seconds(consumer.pid) - start_cpu[1] if args.consumer else None
        if spy is not None:
            spy.wait(30)
            print(f"  profile of the relay: {logs / f'relay-{tag}.folded'}", flush=True)
        if args.consumer and args.profile:
            consumer.send_signal(signal.SIGUSR2)
            time.sleep(1)  # it writes the samples
            report_consumer(logs / f"consumer-{tag}.pickle", len(committed))
    finally:
        for hog in busy:
            hog.kill()
        stop_relays(daemons)
    since = max(committed.values()) - args.window
    window = {e: at for e, at in committed.items() if at >= since}
    lost = [e for e in window if e not in appended]
    if lost:
        raise RuntimeError(f"{len(lost)} events never reached Kafka; see {logs}")
    relay_ms = pct([appended[e] - at * 1000 for e, at in window.items()])
    e2e = pct([(seen[e] - at) * 1000 for e, at in window.items() if e in seen]) if seen else None
    n = len(committed)
    per_event = None if consumer_cpu is None else consumer_cpu / n * 1e6
    stages = budget(window, stamps, appended, seen) if args.stages else None
    return Run(relay_ms, e2e, n, cpu / n * 1e6, cpu / args.seconds, per_event, stages)


def budget(
    window: dict[str, float],
    stamps: dict[str, Path],
    appended: dict[str, int],
    seen: dict[str, float],
) -> dict[str, tuple[float, float]]:
    """The latency budget by stage (p50, p99 ms), from the window's commit times, the
    daemons' stamps (a daemon that stamped nothing: its stages are left out), the broker's
    append times (ms) and the handler's insert times."""
    read, fetched = (
        json.loads(path.read_text()) if path.exists() else {} for path in stamps.values()
    )
    # Each stage: (name, its start, its end), in seconds.
    marks: list[tuple[str, dict[str, float], dict[str, float]]] = []
    append = {e: ms / 1000 for e, ms in appended.items()}
    if read:
        marks += [("commit->read", window, read), ("read->append", read, append)]
    else:
        marks.append(("commit->append", window, append))
    if fetched:
        marks += [("append->fetch", append, fetched), ("fetch->handler", fetched, seen)]
    elif seen:
        marks.append(("append->handler", append, seen))
    out = {}
    for name, start, end in marks:
        values = [(end[e] - start[e]) * 1000 for e in window if e in start and e in end]
        p50, p99, _ = pct(values)
        out[name] = (p50, p99)
    return out


def show(name: str, run: Run) -> str:
    r = run.relay
    line = f"{name}: relay commit->append p50 {r[0]:5.1f} p99 {r[1]:6.1f} max {r[2]:6.0f} ms"
    if run.e2e is not None:
        e = run.e2e
        line += f" | end to end p50 {e[0]:5.1f} p99 {e[1]:6.1f} max {e[2]:6.0f} ms"
    line += (
        f" | relay CPU {run.cpu_us_per_event:.0f} us/event, {100 * run.cpu_share:.1f}% of a core"
    )
    if run.consumer_cpu_us_per_event is not None:
        line += f" | consumer CPU {run.consumer_cpu_us_per_event:.0f} us/event"
    line += f" ({run.events} events)"
    if run.stages:
        parts = [f"{stage} {p50:.1f} ({p99:.1f})" for stage, (p50, p99) in run.stages.items()]
        line += "\n         budget, p50 (p99) ms: " + " | ".join(parts)
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rate", type=float, default=1000)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--window", type=float, default=40, help="seconds at the end measured")
    ap.add_argument("--tick-ms", type=float, default=10, help="batched producer's period")
    ap.add_argument("--single", action="store_true", help="one event per transaction")
    ap.add_argument("--producers", type=int, default=1, help="producer processes")
    ap.add_argument("--keys", type=int, default=500)
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--consumer", action="store_true", help="end to end through outbox consume")
    ap.add_argument(
        "--handler",
        choices=sorted(APPS),
        default="event",
        help="the consumer's handler: one INSERT per event, or a batch handler's one per list",
    )
    ap.add_argument(
        "--stages",
        action="store_true",
        help="the latency budget by stage (the daemons under bench/steady_stages.py)",
    )
    ap.add_argument("--busy", type=int, default=0, help="CPU-bound processes beside them")
    ap.add_argument("--idle", type=float, default=0, help="first measure the idle relay")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="py-spy the relay (needs py-spy); the consumer's CPU by stage (bench/cpuprofile.py)",
    )
    ap.add_argument(
        "--vs",
        metavar="[NAME=]OUTBOX",
        action="append",
        default=[],
        help="another build's outbox executable (repeat for several builds)",
    )
    ap.add_argument(
        "--consumer-vs",
        metavar="NAME=DIR",
        action="append",
        default=[],
        help="another checkout to run the consumer from (PYTHONPATH); implies --consumer",
    )
    ap.add_argument(
        "--checkout",
        metavar="NAME=DIR",
        action="append",
        default=[],
        help="another checkout to run both the relay and the consumer from (PYTHONPATH)",
    )
    ap.add_argument(
        "--source",
        choices=("table", "wal"),
        default="table",
        help="where producers put events and the relay reads them (wal: a slot of this run)",
    )
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args()
    args.consumer = args.consumer or bool(args.consumer_vs)
    args.window = min(args.window, args.seconds)

    base = OutboxSettings()
    dbname = f"bench_steady_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(_dsn(base, "postgres"), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{dbname}"')
    url = make_url(base.database_url.get_secret_value()).set(database=dbname)
    settings = base.model_copy(
        update={"database_url": type(base.database_url)(url.render_as_string(hide_password=False))}
    )
    logs = Path(tempfile.mkdtemp(prefix="bench-steady-"))
    mode = f"{'one event' if args.single else f'{args.tick_ms:g} ms batches'} per transaction"
    print(
        f"steady {args.rate:,.0f} events/s, {mode}, {args.producers} producer process(es), "
        f"{args.keys} keys, {args.partitions} partitions, {args.busy} busy process(es), "
        f"{args.seconds:.0f} s (last "
        f"{args.window:.0f} s measured); {os.cpu_count()} cores, loadavg "
        f"{os.getloadavg()[0]:.2f}",
        flush=True,
    )
    # (name, relay executable, consumer's PYTHONPATH or None for this build, the relay's
    # checkout when known: --stages runs it from there)
    here = str(Path.cwd())
    builds: list[Build] = [("this", own_outbox(), None, here)]
    for i, v in enumerate(args.vs):
        name, exe = v.split("=", 1) if "=" in v else (f"other{i or ''}", v)
        builds.append((name, exe, None, None))
    for i, v in enumerate(args.consumer_vs):
        name, path = v.split("=", 1) if "=" in v else (f"consumer{i or ''}", v)
        builds.append((name, own_outbox(), str(Path(path).resolve()), here))
    for v in args.checkout:
        name, path = v.split("=", 1)
        checkout = str(Path(path).resolve())
        relay = logs / f"outbox-{name}"  # that checkout's CLI, on this interpreter
        relay.write_text(f'#!/bin/sh\nPYTHONPATH={checkout} exec {sys.executable} -m cli "$@"\n')
        relay.chmod(0o755)
        builds.append((name, str(relay), checkout, checkout))
    try:
        migrate.upgrade(settings)
        source = wal_mode(settings) if args.source == "wal" else contextlib.nullcontext(settings)
        with source as settings:
            run_builds(settings, dbname, builds, args, logs)
    finally:
        with psycopg.connect(_dsn(base, "postgres"), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
        asyncio.run(delete_topics(base))
        print(f"logs: {logs}", file=sys.stderr)


def run_builds(
    settings: OutboxSettings,
    dbname: str,
    builds: list[Build],
    args: argparse.Namespace,
    logs: Path,
) -> None:
    """``--pairs`` runs of each build, alternating, and the medians of each."""
    several = len(builds) > 1
    runs: dict[str, list[Run]] = {name: [] for name, *_ in builds}
    for i in range(args.pairs if several else 1):
        # Alternate which build goes first: a drift in the machine's load then
        # spreads over both sides.
        for name, exe, path, relay_path in builds if i % 2 == 0 else builds[::-1]:
            run = one_run(settings, dbname, exe, args, logs, path, relay_path)
            runs[name].append(run)
            print(show(f"  {name:5s}", run), flush=True)
    summary = {}
    for name, rs in runs.items():
        med = {
            "relay_p50_ms": statistics.median(r.relay[0] for r in rs),
            "relay_p99_ms": statistics.median(r.relay[1] for r in rs),
            "relay_cpu_us_per_event": statistics.median(r.cpu_us_per_event for r in rs),
        }
        if all(r.e2e is not None for r in rs):
            med["e2e_p50_ms"] = statistics.median(r.e2e[0] for r in rs if r.e2e)
            med["e2e_p99_ms"] = statistics.median(r.e2e[1] for r in rs if r.e2e)
            med["consumer_cpu_us_per_event"] = statistics.median(
                r.consumer_cpu_us_per_event or 0.0 for r in rs
            )
        if all(r.stages for r in rs):
            for stage in rs[0].stages or {}:
                med[f"{stage}_p50_ms"] = statistics.median(
                    r.stages[stage][0] for r in rs if r.stages and stage in r.stages
                )
        summary[name] = med
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
