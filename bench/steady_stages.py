"""A daemon of ``bench.steady --stages``, stamping each event where it passes a stage.

    python bench/steady_stages.py OUT.json --log-level WARNING relay
    python bench/steady_stages.py OUT.json --log-level WARNING consume bench.steady_app:app

Runs the CLI as its console script does, with a wall-clock stamp per event at the one
point of each daemon the benchmark cannot see from outside: the relay handing a claimed
(or WAL-read) batch to Kafka (``Publisher.publish``), the consumer receiving a fetch (its
Kafka seam's ``fetch``). At exit {event id: first stamp} goes to OUT.json; the benchmark
joins it with the producer's commit times, the broker's LogAppendTime and the handler's
insert time into the latency budget by stage.

A checkout without the wrapped name runs unstamped (a line on stderr says so; its stages
are then missing from the report). Started as a script file and importing nothing from
``bench`` (that would be another checkout's, on its ``PYTHONPATH``), like
``steady_profile.py``. Noting a float per event costs well under a microsecond.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The script's directory (bench/) first on the path would make bench/relay.py the
# top-level `relay` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]

Stamps = dict[str, float]


def _wrap(module: str, qualname: str, note: Callable[[Any, Any, float], None]) -> bool:
    """Replace the coroutine method ``module.qualname`` by one that calls ``note(args,
    result, stamp)`` (stamp: wall clock when it was called); False when it is missing."""
    try:
        owner: Any = importlib.import_module(module)
        *path, name = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = getattr(owner, name)
    except (ImportError, AttributeError):
        return False

    @functools.wraps(original)
    async def stamped(*args: Any, **kwargs: Any) -> Any:
        at = time.time()
        result = await original(*args, **kwargs)
        note(args, result, at)
        return result

    setattr(owner, name, stamped)
    return True


def _relay(stamps: Stamps) -> bool:
    try:
        ce_id = importlib.import_module("relay.event").CE_ID
    except (ImportError, AttributeError):
        return False

    def note(args: Any, result: Any, at: float) -> None:
        for row in args[1]:  # (self, rows, ...): the batch handed to Kafka
            stamps.setdefault(row[ce_id], at)  # a retry keeps the first hand-over

    return _wrap("relay.kafka.publisher", "Publisher.publish", note)


def _consumer(stamps: Stamps) -> bool:
    def note(args: Any, batches: Any, at: float) -> None:
        now = time.time()  # when the fetch returned: the records' arrival
        for records in batches.values():
            for record in records:
                for key, value in record.headers:
                    if key == "ce_id":
                        stamps.setdefault(value.decode(), now)
                        break

    return _wrap("outbox.kafka.aiokafka_consumer", "AioConsumer.fetch", note)


def run() -> None:
    out = Path(sys.argv.pop(1))
    stamps: Stamps = {}
    command = next((a for a in sys.argv[1:] if a in ("relay", "consume")), None)
    hooked = {"relay": _relay, "consume": _consumer}.get(command or "", lambda s: False)(stamps)
    if not hooked:
        print(f"steady_stages: no stage stamped in {command!r} of this checkout", file=sys.stderr)
    atexit.register(lambda: out.write_text(json.dumps(stamps)))
    from cli.app import main

    main()


if __name__ == "__main__":
    run()
