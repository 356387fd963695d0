"""Relay memory benchmark: one ``outbox relay`` process drains a backlog of large rows; its
resident memory is sampled from ``/proc/PID/status`` (VmRSS) while it works, and its peak
(VmHWM) is read just before it is stopped.

    python -m bench.relay_memory                          # 400 rows of 900 KB
    python -m bench.relay_memory --rows 2000 --row-bytes 300
    python -m bench.relay_memory --outbox /path/to/other/venv/bin/outbox   # another build

Payloads are random hex (TOAST compresses them about 2:1, as it would real data with some
entropy). The topic allows records up to ``--row-bytes`` plus room for headers. Needs the
services of ``scripts/services up`` (or OUTBOX_DATABASE_URL and
OUTBOX_KAFKA_BOOTSTRAP_SERVERS); works in a scratch schema that it drops at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psycopg

from bench.common import create_topic, delete_topics, drop_schema, relay_env, scratch_settings
from bench.relay import pending
from outbox.envelope import lane_for
from outbox.settings import OutboxSettings

KEYS = 200


def status_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of ``pid`` in KiB (``/proc/PID/status``)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(value.split()[0])
    return out


def fill(settings: OutboxSettings, topic: str, rows: int, row_bytes: int) -> None:
    """Commit ``rows`` pending events of ``row_bytes`` each, 20 rows per statement."""
    keys = [f"k{i}".encode() for i in range(KEYS)]
    lanes = [lane_for(k, uuid.uuid4(), settings.lanes) for k in keys]
    events = f'"{settings.db_schema}"."{settings.table_prefix}events"'
    chunks = (row_bytes + 31) // 32
    with psycopg.connect(settings.libpq_dsn) as conn:
        for start in range(0, rows, 20):
            conn.execute(
                f"INSERT INTO {events} (event_id, topic, key, lane, event_type, source,"
                " content_type, payload, fingerprint)"
                " SELECT gen_random_uuid(), %(topic)s, (%(keys)s::bytea[])[1 + g %% %(k)s],"
                " (%(lanes)s::int2[])[1 + g %% %(k)s], 'bench.large', 'urn:bench',"
                " 'application/octet-stream',"
                " substring(convert_to((SELECT string_agg(md5(random()::text || g || i), '')"
                "  FROM generate_series(1, %(chunks)s::int) i), 'UTF8') FOR %(size)s::int),"
                " '\\x00'::bytea FROM generate_series(%(start)s::int, %(end)s::int) g",
                {
                    "topic": topic,
                    "keys": keys,
                    "lanes": lanes,
                    "k": KEYS,
                    "chunks": chunks,
                    "size": row_bytes,
                    "start": start,
                    "end": min(start + 20, rows) - 1,
                },
            )
        conn.commit()


def drain(
    settings: OutboxSettings, topic: str, rows: int, row_bytes: int, outbox: str, logs: Path
) -> tuple[float, int, int, list[int]]:
    """Start one relay, then commit the backlog in one transaction (the relay sees all of
    it at once, as after a restart); (seconds from that commit until the outbox is empty,
    peak KiB, idle KiB before the backlog, RSS samples in KiB)."""
    log = (logs / "relay.log").open("wb")
    env = relay_env(settings)
    env["OUTBOX_MAX_PAYLOAD_BYTES"] = str(max(row_bytes + 4096, settings.max_payload_bytes))
    proc = subprocess.Popen(
        [outbox, "--log-level", "WARNING", "relay"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    samples: list[int] = []
    try:
        time.sleep(3)  # connected, lanes owned: the idle footprint
        idle = status_kib(proc.pid)["VmRSS"]
        fill(settings, topic, rows, row_bytes)
        t0 = time.perf_counter()
        left = rows
        while left and time.perf_counter() - t0 < 600:
            samples.append(status_kib(proc.pid)["VmRSS"])
            time.sleep(0.05)
            left = pending(settings)
        elapsed = time.perf_counter() - t0
        peak = status_kib(proc.pid)["VmHWM"]
        if left:
            raise RuntimeError(f"relay left {left} rows; see {logs}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    return elapsed, peak, idle, samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--row-bytes", type=int, default=900_000)
    ap.add_argument("--partitions", type=int, default=6)
    exe = Path(sys.executable).with_name("outbox")
    ap.add_argument("--outbox", default=str(exe), help="the outbox executable to measure")
    args = ap.parse_args()

    settings = scratch_settings()
    logs = Path(tempfile.mkdtemp(prefix="bench-relay-memory-"))
    try:
        limit = str(max(args.row_bytes + 65_536, 1_048_588))
        topic = asyncio.run(
            create_topic(settings, args.partitions, {"max.message.bytes": limit}, "bench-mem")
        )
        elapsed, peak, idle, samples = drain(
            settings, topic, args.rows, args.row_bytes, args.outbox, logs
        )
        mib = 1024
        print(
            f"load: {os.cpu_count()} cores, loadavg {os.getloadavg()[0]:.2f}; "
            f"{args.rows} rows of {args.row_bytes:,} B ({args.rows * args.row_bytes / 2**20:,.0f}"
            f" MiB) drained in {elapsed:.1f} s by {args.outbox}"
        )
        print(
            f"relay RSS: idle {idle / mib:.0f} MiB, peak (VmHWM) {peak / mib:.0f} MiB, "
            f"largest sample {max(samples, default=0) / mib:.0f} MiB"
        )
        print(
            json.dumps(
                {
                    "rows": args.rows,
                    "row_bytes": args.row_bytes,
                    "seconds": elapsed,
                    "idle_mib": idle / mib,
                    "peak_mib": peak / mib,
                    "loadavg": os.getloadavg()[0],
                }
            )
        )
    finally:
        drop_schema(settings)
        asyncio.run(delete_topics(settings))


if __name__ == "__main__":
    main()
