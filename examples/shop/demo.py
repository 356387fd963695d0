"""The main job, end to end: order service -> outbox -> relay -> Kafka -> inbox consumer.

    python -m examples.shop.demo [--orders 2000] [--rate 300] [--relays 2]

Migrates, creates the topics, starts relay and consumer daemons as subprocesses (the same
``outbox relay`` / ``outbox consume`` commands operators run), produces order lifecycles
(created -> paid -> shipped, each step its own transaction) at a steady rate, shows live
progress and lag, then checks the promise: 0 lost, 0 duplicate effects, 0 out-of-order
pairs per order; stops the daemons with SIGTERM and exits non-zero if anything was off.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table
from sqlalchemy import Engine, func, select, text
from sqlalchemy.orm import Session

from examples.shop.consumer import metadata as consumer_metadata
from examples.shop.consumer import shipping_log
from examples.shop.events import TOPIC
from examples.shop.service import OrderService
from examples.shop.service import metadata as service_metadata
from outbox import Outbox, load_settings, migrate
from outbox.db import sync_engine
from outbox.ops.topics import consumer_topics, ensure

ROOT = Path(__file__).resolve().parents[2]
console = Console()


@contextmanager
def daemon(name: str, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``outbox <args>`` as a subprocess; SIGTERM it on exit and report its exit code."""
    log = open(ROOT / ".services" / f"demo-{name}.log", "ab")  # noqa: SIM115 - closed below
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "cli", *args], stdout=log, stderr=log, env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        verdict = (
            "[green]clean exit[/]" if proc.returncode == 0 else f"[red]exit {proc.returncode}[/]"
        )
        console.print(f"{name}: {verdict} (log: .services/demo-{name}.log)")


def snapshot(engine: Engine, outbox: Outbox, run_prefix: str) -> dict[str, float]:
    events = outbox.tables.events
    with engine.connect() as conn:
        pending, oldest = conn.execute(
            select(
                func.count(),
                func.coalesce(func.extract("epoch", func.now() - func.min(events.c.created_at)), 0),
            ).where(events.c.published_at.is_(None))
        ).one()
        applied, duplicates = conn.execute(
            text(
                "SELECT count(*), count(*) - count(DISTINCT (order_id, seq)) "
                f"FROM {shipping_log.name} WHERE order_id LIKE :run"
            ),
            {"run": f"{run_prefix}%"},
        ).one()
    return {
        "pending": pending,
        "oldest_age_s": float(oldest),
        "applied": applied,
        "duplicates": duplicates,
    }


def out_of_order_pairs(engine: Engine, run_prefix: str) -> int:
    """Pairs of consecutive effects of one order whose seq did not increase."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT count(*) FROM (SELECT seq, lag(seq) OVER "
                    "(PARTITION BY order_id ORDER BY applied_id) AS prev "
                    f"FROM {shipping_log.name} WHERE order_id LIKE :run) s "
                    "WHERE prev IS NOT NULL AND seq <= prev"
                ),
                {"run": f"{run_prefix}%"},
            ).scalar_one()
        )


def render(stats: dict[str, float], produced: int, expected: int, elapsed: float) -> Table:
    table = Table(title=f"outbox-inbox demo  ({elapsed:5.1f} s)", min_width=60)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("events produced (committed)", f"{produced:,} / {expected:,}")
    table.add_row("outbox pending", f"{stats['pending']:,.0f}")
    table.add_row("oldest pending age", f"{stats['oldest_age_s']:.2f} s")
    table.add_row("effects applied by consumer", f"{stats['applied']:,.0f}")
    table.add_row("duplicate effects", f"{stats['duplicates']:,.0f}")
    return table


def produce_step(engine: Engine, service: OrderService, order: tuple[str, str, int]) -> None:
    order_id, customer, step = order
    with Session(engine) as session, session.begin():
        if step == 1:
            service.pay(session, order_id, customer, amount=random.randint(500, 50_000))
        else:
            service.ship(session, order_id, customer)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--orders", type=int, default=1000, help="orders to run through their life")
    parser.add_argument("--rate", type=float, default=600, help="events per second to produce")
    parser.add_argument("--relays", type=int, default=2, help="relay processes to run")
    parser.add_argument(
        "--timeout", type=float, default=120, help="seconds to wait for the consumer"
    )
    args = parser.parse_args()

    settings = load_settings()
    console.print(
        f"database {settings.safe_database_url}, kafka {settings.kafka_bootstrap_servers}"
    )
    migrate.upgrade(settings)
    engine = sync_engine(settings, pool_size=4)
    service_metadata.create_all(engine)
    consumer_metadata.create_all(engine)
    # What `outbox topics ensure --topic shop.orders:6 --app examples.shop.consumer:app` does.
    specs = consumer_topics(settings, [TOPIC], {TOPIC: 6})
    for result in asyncio.run(ensure(settings, specs)):
        console.print(f"topic {result.topic}: {result.status} ({result.partitions} partitions)")
    # Earlier runs' effects (and their late events) stay around; this run counts only the
    # orders it created, recognised by a per-run prefix of their ids.
    run_prefix = f"ord-{uuid.uuid4().hex[:6]}-"
    service = OrderService(Outbox(settings), order_prefix=run_prefix)
    expected = args.orders * 3
    (ROOT / ".services").mkdir(exist_ok=True)

    with ExitStack() as daemons:
        daemons.enter_context(daemon("consumer", "consume", "examples.shop.consumer:app"))
        for i in range(args.relays):
            daemons.enter_context(daemon(f"relay-{i + 1}", "relay"))
        live_orders: list[tuple[str, str, int]] = []
        produced = 0
        started = time.monotonic()
        with Live(console=console, refresh_per_second=4) as live:
            while produced < expected:
                # Interleave new orders with later steps of open ones, so keys interleave.
                if live_orders and (
                    len(live_orders) > 50 or produced // 3 >= args.orders or random.random() < 0.6
                ):
                    i = random.randrange(len(live_orders))
                    order_id, customer, step = live_orders[i]
                    produce_step(engine, service, live_orders[i])
                    if step == 2:
                        live_orders.pop(i)
                    else:
                        live_orders[i] = (order_id, customer, step + 1)
                else:
                    with Session(engine) as session, session.begin():
                        customer = f"cus-{random.randint(1, 500):04d}"
                        live_orders.append((service.place(session, customer), customer, 1))
                produced += 1
                # pace to the target rate
                ahead = produced / args.rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
                if produced % 50 == 0:
                    live.update(
                        render(
                            snapshot(engine, service.outbox, run_prefix),
                            produced,
                            expected,
                            time.monotonic() - started,
                        )
                    )
            deadline = time.monotonic() + args.timeout
            stats = snapshot(engine, service.outbox, run_prefix)
            while stats["applied"] - stats["duplicates"] < expected and time.monotonic() < deadline:
                time.sleep(0.25)
                stats = snapshot(engine, service.outbox, run_prefix)
                live.update(render(stats, produced, expected, time.monotonic() - started))
        console.print()

    disorder = out_of_order_pairs(engine, run_prefix)
    lost = expected - int(stats["applied"] - stats["duplicates"])
    engine.dispose()
    console.print(
        f"produced {expected:,} events for {args.orders:,} orders; "
        f"applied {int(stats['applied']):,}; "
        f"lost {lost}, duplicate effects {int(stats['duplicates'])}, out-of-order pairs {disorder}"
    )
    ok = lost == 0 and stats["duplicates"] == 0 and disorder == 0
    console.print(
        "[bold green]all events applied exactly once, in order[/]" if ok else "[bold red]FAILED[/]"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
