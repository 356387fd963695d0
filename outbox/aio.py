"""Running the daemons' event loop: uvloop when it is installed, asyncio's own otherwise.

The consumer and the relay spend most of their CPU in event-loop and driver overhead per
statement (small batches at moderate rates); uvloop cuts that overhead, which is what
bounds latency on a busy host.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on the fastest available loop."""
    # What exists by now (modules, the application's handlers and models) lives as long as
    # the process: out of the collector's reach, a full collection scans only what the
    # daemon allocated since — a pause of ~1 ms instead of ~100 ms, a p99 hit otherwise.
    gc.freeze()
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(main)
