"""Sleeping that a stopping relay (or a producer's wake-up) can cut short."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import psycopg


async def sleep_unless(stopping: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds``, but return at once when ``stopping`` is set."""
    if seconds <= 0:
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stopping.wait(), seconds)


async def sleep_unless_notified(
    conn: psycopg.AsyncConnection[Any], stopping: asyncio.Event, seconds: float
) -> bool:
    """Like :func:`sleep_unless`, but also return at the first notification ``conn`` (a
    LISTENing session, idle) receives, or at once for one received while it was busy;
    True when a notification ended it."""
    if seconds <= 0:
        return False
    notified = conn.notifies(timeout=seconds, stop_after=1)
    waiter = asyncio.ensure_future(anext(notified, None))
    stopper = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        return waiter.done() and not waiter.cancelled() and waiter.result() is not None
    finally:
        stopper.cancel()
        waiter.cancel()  # a cancelled wait leaves the idle session as it was
        with contextlib.suppress(asyncio.CancelledError):
            await waiter
        await notified.aclose()


async def drop_notifications(conn: psycopg.AsyncConnection[Any]) -> None:
    """Drop the notifications ``conn`` received so far (psycopg keeps them until read)."""
    async for _ in conn.notifies(timeout=0):
        pass
