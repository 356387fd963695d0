"""Producer throughput: single-row transactions vs publish_many.

    python -m bench.producer [--single 3000] [--clients 1,4] [--bulk 100000] [--batch 1000]
    python -m bench.producer --wake off,on,sleeping --rounds 3   # the wake trigger's cost

Needs OUTBOX_DATABASE_URL (e.g. `eval "$(scripts/services env)"`). Writes into a scratch
schema that is dropped afterwards.

``--wake`` measures the relay's wake-up trigger (outbox/wake.py) in the same run, the modes
alternating round after round: ``off`` (the trigger disabled: no wake-ups, the release
before), ``on`` (the trigger, no relay sleeping: what producers pay while relays are busy),
``sleeping`` (a session holds a wake slot, as a sleeping relay does: every transaction
notifies, which serializes commits).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from bench.common import drop_schema, payload_300b, scratch_settings
from outbox import Message, Outbox
from outbox.db import sync_engine
from outbox.settings import OutboxSettings
from outbox.wake import wake_namespace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--single", type=int, default=3000, help="single-row transactions per client"
    )
    parser.add_argument("--clients", default="1,4", help="concurrent clients for single-row runs")
    parser.add_argument("--bulk", type=int, default=100_000, help="rows for publish_many")
    parser.add_argument("--batch", type=int, default=1000, help="rows per publish_many call")
    parser.add_argument("--wake", default="on", help="trigger modes: off, on, sleeping")
    parser.add_argument("--rounds", type=int, default=1, help="rounds over the --wake modes")
    args = parser.parse_args()

    settings = scratch_settings()
    ob = Outbox(settings)
    engine = sync_engine(settings, pool_size=16)
    modes = args.wake.split(",")
    figures: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
    try:
        print(f"producer bench: schema {settings.db_schema}, payload ~300 B, synchronous_commit=on")
        for r in range(args.rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                with wake_mode(engine, settings, mode):
                    for name, rate in measure(ob, engine, args).items():
                        figures[mode].setdefault(name, []).append(rate)
                        print(f"  {mode:8s} {name}: {rate:,.0f} rows/s", flush=True)
        if len(modes) > 1 or args.rounds > 1:
            print("medians:")
            for name in figures[modes[0]]:
                cells = [f"{m} {statistics.median(figures[m][name]):,.0f}" for m in modes]
                print(f"  {name}: " + " | ".join(cells) + " rows/s")
    finally:
        engine.dispose()
        drop_schema(settings)


@contextlib.contextmanager
def wake_mode(engine: Engine, settings: OutboxSettings, mode: str) -> Iterator[None]:
    events = f'"{settings.db_schema}"."{settings.table_prefix}events"'
    ns = wake_namespace(settings.db_schema, settings.table_prefix)
    with engine.connect() as conn:
        conn.execute(
            text(f"ALTER TABLE {events} {'DISABLE' if mode == 'off' else 'ENABLE'} TRIGGER USER")
        )
        conn.commit()
        if mode == "sleeping":
            conn.execute(text("SELECT pg_advisory_lock(:ns, 0)"), {"ns": ns})
        try:
            yield
        finally:
            if mode == "sleeping":
                conn.execute(text("SELECT pg_advisory_unlock(:ns, 0)"), {"ns": ns})
            conn.commit()


def measure(ob: Outbox, engine: Engine, args: argparse.Namespace) -> dict[str, float]:
    """Rows/s of single-row transactions per client count, and of publish_many."""
    out = {}
    for clients in (int(c) for c in args.clients.split(",")):

        def client(offset: int) -> None:
            for n in range(args.single):
                with Session(engine) as session, session.begin():
                    ob.publish(
                        session,
                        topic="orders",
                        key=f"k{n % 100}",
                        event_type="order.created",
                        payload=payload_300b(offset + n),
                    )

        start = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(client, [i * args.single for i in range(clients)]))
        out[f"single-row transactions, {clients} client(s)"] = (
            clients * args.single / (time.perf_counter() - start)
        )

    start = time.perf_counter()
    for first in range(0, args.bulk, args.batch):
        with Session(engine) as session, session.begin():
            ob.publish_many(
                session,
                [
                    Message(
                        topic="orders",
                        key=f"k{n % 100}",
                        event_type="order.created",
                        payload=payload_300b(n),
                    )
                    for n in range(first, min(first + args.batch, args.bulk))
                ],
            )
    out[f"publish_many ({args.batch}/tx), 1 client"] = args.bulk / (time.perf_counter() - start)
    return out


if __name__ == "__main__":
    main()
