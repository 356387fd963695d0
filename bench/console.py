"""Console page load with 10,000 dead letters (not a timed test): the dead-letter list,
filtered, as an operator's browser gets it from ``outbox console`` (a real process over
HTTP: filters, the error-group table, the count and one page of 100 rows).

    python -m bench.console [--letters 10000] [--requests 30]

Target: < 300 ms per page.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import httpx

from bench.common import drop_schema, scratch_settings
from tests.support.console import console_process, seed_dead_letters

# (consumer, error class, message): six error groups over three consumers.
SHAPES = [
    ("billing", "PaymentDeclined", "card ending {i} declined for order {uuid}"),
    ("billing", "KeyError", "'customer' missing in order {i}"),
    ("shipping", "LabelPrinterOffline", "printer {i} offline (job {uuid})"),
    ("shipping", "TimeoutError", "carrier API timed out after {i} ms"),
    ("mailer", "SMTPRecipientsRefused", "recipient {uuid}@example.com refused"),
    ("mailer", "ValidationError", "field 'email' invalid at position {i}"),
]
PAGES = {
    "consumer": "/dead-letters?consumer=billing",
    "consumer+class": "/dead-letters?consumer=shipping&error_class=LabelPrinterOffline",
    "unfiltered": "/dead-letters",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--letters", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=30)
    args = parser.parse_args()
    settings = scratch_settings()
    try:
        per_shape = args.letters // len(SHAPES)
        payload = b'{"order_id": "ord-0000000001", "total_cents": 1999, "currency": "EUR"}'
        for consumer, error_class, message in SHAPES:
            seed_dead_letters(
                settings,
                per_shape,
                consumer=consumer,
                error_class=error_class,
                message=message,
                value=payload,
            )
        total = per_shape * len(SHAPES)
        with console_process(settings) as (url, _), httpx.Client(base_url=url) as client:
            print(f"{total} dead letters, {args.requests} requests per page")
            # An error group chosen, as the group's link does.
            first_group = re.search(
                r'data-group="([0-9a-f]{32})"', client.get(PAGES["consumer"]).text
            )
            assert first_group is not None
            pages = {**PAGES, "consumer+group": f"{PAGES['consumer']}&group={first_group[1]}"}
            for name, path in pages.items():
                client.get(path).raise_for_status()  # warm: connections, templates
                times = []
                for _ in range(args.requests):
                    start = time.perf_counter()
                    response = client.get(path)
                    times.append((time.perf_counter() - start) * 1000)
                    response.raise_for_status()
                times.sort()
                p95 = times[int(len(times) * 0.95) - 1]
                print(
                    f"{name:15} median {statistics.median(times):6.1f} ms  p95 {p95:6.1f} ms  "
                    f"max {times[-1]:6.1f} ms  ({len(response.content) // 1024} KiB)"
                )
    finally:
        drop_schema(settings)


if __name__ == "__main__":
    main()
