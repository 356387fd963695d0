"""Running the daemons' event loop: uvloop when it is installed, asyncio's own otherwise.

The consumer and the relay spend most of their CPU in event-loop and driver overhead per
statement (small batches at moderate rates); uvloop cuts that overhead, which is what
bounds latency on a busy host.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from aiokafka.errors import KafkaError

from outbox.kafka import aiokafka_internals

T = TypeVar("T")
log = logging.getLogger("outbox.daemon")


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run_daemon(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on the fastest available loop."""
    # What exists by now (modules, the application's handlers and models) lives as long as
    # the process: out of the collector's reach, a full collection scans only what the
    # daemon allocated since: a pause a hundred times shorter, a p99 hit otherwise
    # (docs/performance/relay.md).
    gc.freeze()
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.get_loop().set_exception_handler(_report)
        return runner.run(main)


def _report(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """asyncio's report of an error nobody handled, except one kind: a request aiokafka
    runs shielded in a task of its own (``aiokafka_internals.is_shielded_request``), given up by
    the daemon (a broker that does not answer, at stop) and failing afterwards. Nothing
    waits for that answer any more: one DEBUG line, not an ERROR with a traceback.
    (Reports made as asyncio.run() ends carry the task under another key: left as they
    are.)"""
    task, exc = context.get("future"), context.get("exception")
    if (
        isinstance(task, asyncio.Task)
        and aiokafka_internals.is_shielded_request(task)
        and isinstance(exc, KafkaError)
    ):
        log.debug("a Kafka request given up earlier failed: %r", exc)
        return
    loop.default_exception_handler(context)
