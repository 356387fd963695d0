"""Producer cost per event, table source vs WAL source (issue 39):

    python -m bench.producer_wal [--single 2000] [--calls 200] [--pairs 3]

Per event: wall time and the client's CPU time (``time.process_time``), for ``publish``
in one-event transactions and ``publish_many`` of 100 per transaction, with
``OUTBOX_SOURCE=table`` (INSERT) and ``wal`` (``pg_logical_emit_message``). The WAL source
packs a call's events into one message; ``wal, message per event`` is the other choice
(one message per event in the same statement), measured to pick. ``unchecked`` is the
WAL producer without its slot gate (issue 51: no event emitted while the slot is missing),
the baseline the gate's cost is read against. Rounds alternate. Needs OUTBOX_DATABASE_URL
and a role that may create a replication slot: writes into a scratch schema and a slot
of its own (nothing reads it), both dropped afterwards.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

from sqlalchemy import Engine, text

from bench.common import drop_schema, payload_300b, scratch_settings
from outbox import Message, Outbox, wal_codec
from outbox.db import sync_engine
from outbox.settings import OutboxSettings
from outbox.store import WalProducerStore


def _messages(first: int, n: int) -> list[Message]:
    return [
        Message(
            topic="orders", key=f"k{i % 100}", event_type="order.created", payload=payload_300b(i)
        )
        for i in range(first, first + n)
    ]


def _timed(run: Callable[[], int]) -> tuple[float, float]:
    """(wall µs, CPU µs) per event of ``run`` (which returns its event count)."""
    wall, cpu = time.perf_counter(), time.process_time()
    events = run()
    return (
        (time.perf_counter() - wall) / events * 1e6,
        (time.process_time() - cpu) / events * 1e6,
    )


def single(engine: Engine, ob: Outbox, count: int) -> int:
    for n in range(count):
        with engine.begin() as conn:
            ob.publish(
                conn,
                topic="orders",
                key=f"k{n % 100}",
                event_type="order.created",
                payload=payload_300b(n),
            )
    return count


def many(engine: Engine, ob: Outbox, calls: int) -> int:
    for c in range(calls):
        with engine.begin() as conn:
            ob.publish_many(conn, _messages(c * 100, 100))
    return calls * 100


def many_per_event(engine: Engine, ob: Outbox, settings: OutboxSettings, calls: int) -> int:
    """The alternative encoding: one message per event (prepared as publish does)."""
    store = WalProducerStore(settings.wal.prefix, settings.wal.slot)
    for c in range(calls):
        rows = ob._prepare(_messages(c * 100, 100))  # the producer's own preparation
        with engine.begin() as conn:
            conn.execute(*store.emit([wal_codec.encode([r]) for r in rows]))
    return calls * 100


def unchecked(settings: OutboxSettings) -> Outbox:
    """The WAL producer with its slot gate off (the baseline of the gate's cost)."""
    ob = Outbox(settings)
    ob._wal = WalProducerStore(settings.wal.prefix)  # no slot: emitted unconditionally
    return ob


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--single", type=int, default=2000, help="one-event transactions")
    ap.add_argument("--calls", type=int, default=200, help="publish_many calls of 100")
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args()
    table = scratch_settings()
    slot = f"outbox_bench_{os.getpid()}"
    wal = table.model_copy(
        update={"source": "wal", "wal": table.wal.model_copy(update={"slot": slot})}
    )
    engine = sync_engine(table, pool_size=2)
    with engine.begin() as conn:
        conn.execute(text("SELECT pg_create_logical_replication_slot(:s, 'pgoutput')"), {"s": slot})
    cases: dict[str, Callable[[], int]] = {
        "publish, table": lambda: single(engine, Outbox(table), args.single),
        "publish, wal": lambda: single(engine, Outbox(wal), args.single),
        "publish, wal, unchecked": lambda: single(engine, unchecked(wal), args.single),
        "publish_many 100, table": lambda: many(engine, Outbox(table), args.calls),
        "publish_many 100, wal": lambda: many(engine, Outbox(wal), args.calls),
        "publish_many 100, wal, unchecked": lambda: many(engine, unchecked(wal), args.calls),
        "publish_many 100, wal, message per event": lambda: many_per_event(
            engine, Outbox(wal), wal, args.calls
        ),
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    try:
        print(f"producer cost per event, payload ~300 B; load {os.getloadavg()[0]:.2f}")
        for _ in range(args.pairs):
            for name, run in cases.items():
                results[name].append(_timed(run))
        for name, values in results.items():
            wall = statistics.median(v[0] for v in values)
            cpu = statistics.median(v[1] for v in values)
            print(f"{name:42} wall {wall:8.1f} µs/event, client CPU {cpu:7.1f} µs/event")
        print(f"load {os.getloadavg()[0]:.2f}")
    finally:
        with engine.begin() as conn:
            conn.execute(text("SELECT pg_drop_replication_slot(:s)"), {"s": slot})
        engine.dispose()
        drop_schema(table)


if __name__ == "__main__":
    main()
