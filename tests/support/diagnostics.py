"""What a test consumer app shows of itself when a test asks (the broker-fault tests).

``install()``, called by the test apps (tests/support/inbox_apps.py, batch_apps.py) when
they are imported by ``outbox consume``, reads two INBOX_TEST_* variables (the library
never does):

* ``INBOX_TEST_GROUP_LOG``: what the member does with its group (coordinator lookups,
  joins, heartbeat failures) and its fetches' failures, in aiokafka's own words, to that
  file, stamped in epoch seconds (tests/support/faults.py lines them up with the fault).
  The CLI keeps aiokafka at WARNING and rate-limits it, so they go to a file of their own.
* ``INBOX_TEST_TASK_DUMPS``: on SIGUSR1, where every task waits (its chain of awaits),
  appended to that file: what a stalled consumer waits on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time


def install() -> None:
    if group_log := os.environ.get("INBOX_TEST_GROUP_LOG"):
        handler = logging.FileHandler(group_log)
        handler.setFormatter(logging.Formatter("%(created).3f %(levelname)s %(name)s: %(message)s"))
        for name in ("aiokafka.consumer.group_coordinator", "aiokafka.consumer.fetcher"):
            logger = logging.getLogger(name)
            logger.setLevel(logging.INFO)
            logger.addHandler(handler)
            logger.propagate = False
    if task_dumps := os.environ.get("INBOX_TEST_TASK_DUMPS"):
        signal.signal(signal.SIGUSR1, lambda *_: _dump_tasks(task_dumps))


def _awaits(coro: object) -> str:
    where = []
    while coro is not None and len(where) < 12:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            where.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return " > ".join(where)


def _dump_tasks(path: str) -> None:
    """Runs inside whatever frame the signal interrupted (the event loop's thread): it
    must never raise (a first version's exception killed aiokafka's fetcher task)."""
    try:
        lines = [f"=== {time.time():.3f}"]
        lines += [f"{t.get_name()}: {_awaits(t.get_coro())}" for t in asyncio.all_tasks()]
        with open(path, "a") as f:
            f.write("\n".join(lines) + "\n")
    except Exception:
        pass
