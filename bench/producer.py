"""Producer throughput: single-row transactions vs publish_many.

    python -m bench.producer [--single 3000] [--clients 1,4] [--bulk 100000] [--batch 1000]

Needs OUTBOX_DATABASE_URL (e.g. `eval "$(scripts/services env)"`). Writes into a scratch
schema that is dropped afterwards.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy.orm import Session

from bench.common import drop_schema, payload_300b, scratch_settings
from outbox import Message, Outbox
from outbox.db import sync_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--single", type=int, default=3000, help="single-row transactions per client"
    )
    parser.add_argument("--clients", default="1,4", help="concurrent clients for single-row runs")
    parser.add_argument("--bulk", type=int, default=100_000, help="rows for publish_many")
    parser.add_argument("--batch", type=int, default=1000, help="rows per publish_many call")
    args = parser.parse_args()

    settings = scratch_settings()
    ob = Outbox(settings)
    engine = sync_engine(settings, pool_size=16)
    try:
        print(f"producer bench: schema {settings.db_schema}, payload ~300 B, synchronous_commit=on")
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
            elapsed = time.perf_counter() - start
            total = clients * args.single
            print(
                f"single-row transactions, {clients} client(s): "
                f"{total / elapsed:,.0f} rows/s ({total} rows)"
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
        elapsed = time.perf_counter() - start
        print(
            f"publish_many ({args.batch}/tx), 1 client: "
            f"{args.bulk / elapsed:,.0f} rows/s ({args.bulk} rows)"
        )
    finally:
        engine.dispose()
        drop_schema(settings)


if __name__ == "__main__":
    main()
