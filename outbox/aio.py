"""Running the daemons' event loop: uvloop when it is installed, asyncio's own otherwise.

The consumer and the relay spend most of their CPU in event-loop and driver overhead per
statement (small batches at moderate rates); uvloop cuts that overhead, which is what
bounds latency on a busy host.
"""

from __future__ import annotations

import asyncio
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
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(main)
