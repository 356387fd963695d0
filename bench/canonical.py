"""CPU cost of canonical JSON (RFC 8785) next to the producer's payload encoding.

    python -m bench.canonical [--n 20000]

No services needed. Prints microseconds per call for the ~300-byte order event of the
producer bench: pydantic's ``to_json`` (what ``publish`` stores), ``canonical_json`` of the
same dict, a whole ``envelope.prepare``, ``idempotency_key`` with that payload, and the
conflict-path comparison ``same_event`` (parse both payloads, canonicalize both).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from pydantic_core import to_json

from bench.common import payload_300b
from outbox import Message, canonical_json, idempotency_key
from outbox.envelope import Row, StoredEvent, prepare, same_event


def _per_call_us(fn: Callable[[int], object], n: int) -> float:
    for i in range(min(n, 1000)):  # warm up
        fn(i)
    start = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=20_000, help="calls per measurement")
    n = parser.parse_args().n
    payloads = [payload_300b(i) for i in range(n)]
    print(f"canonical bench: {n} calls each, payload {len(to_json(payloads[0]))} B")

    def prep(i: int) -> Row:
        message = Message(topic="orders", payload=payloads[i], event_type="order.created")
        return prepare(message, lanes=64, max_bytes=1 << 20, default_source="urn:bench")

    row = prep(0)
    reordered = to_json(dict(reversed(list(payloads[0].items()))))
    stored = StoredEvent(row.topic, row.key, row.event_type, row.content_type, reordered)
    cases: list[tuple[str, Callable[[int], object]]] = [
        ("to_json (stored payload bytes)", lambda i: to_json(payloads[i])),
        ("canonical_json (RFC 8785)", lambda i: canonical_json(payloads[i])),
        ("envelope.prepare (whole row)", prep),
        ("idempotency_key with payload", lambda i: idempotency_key("o", i, payload=payloads[i])),
        ("same_event (conflict path only)", lambda i: same_event(row, stored)),
    ]
    for name, fn in cases:
        print(f"{name:34s} {_per_call_us(fn, n):8.2f} us/call")


if __name__ == "__main__":
    main()
