"""Sleeping that a stopping relay can cut short."""

from __future__ import annotations

import asyncio
import contextlib


async def sleep_unless(stopping: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds``, but return at once when ``stopping`` is set."""
    if seconds <= 0:
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stopping.wait(), seconds)
