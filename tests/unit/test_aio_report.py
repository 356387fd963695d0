"""The daemons' loop report (outbox/aio.py): an aiokafka task left failing after a bounded
stop is one DEBUG line; anything else keeps asyncio's report."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from aiokafka.errors import RequestTimedOutError

from outbox import aio


def _aiokafka_style(exc: BaseException) -> Any:
    # A coroutine function whose code says it lives in aiokafka, as its shielded offset
    # commit does (GroupCoordinator._do_commit_offsets).
    namespace: dict[str, Any] = {}
    source = "async def _do_commit_offsets(exc):\n    raise exc\n"
    exec(compile(source, "/venv/site-packages/aiokafka/consumer/x.py", "exec"), namespace)
    return namespace["_do_commit_offsets"](exc)


async def _ours(exc: BaseException) -> None:
    raise exc


def _unretrieved(coro: Any) -> list[dict[str, Any]]:
    """Run ``coro`` as a task nobody reads, on a loop with the daemons' report, and report
    it as asyncio does; what reached asyncio's default handler."""
    seen: list[dict[str, Any]] = []
    loop = asyncio.new_event_loop()
    try:
        loop.set_exception_handler(aio._report)
        loop.default_exception_handler = seen.append  # type: ignore[method-assign,assignment]
        task = loop.create_task(coro)
        loop.run_until_complete(asyncio.sleep(0.01))
        assert task.done()
        loop.call_exception_handler(
            {
                "message": "Task exception was never retrieved",
                "exception": task.exception(),
                "future": task,
            }
        )
    finally:
        loop.close()
    return seen


def test_an_aiokafka_tasks_kafka_error_is_one_debug_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, "outbox.daemon")
    seen = _unretrieved(_aiokafka_style(RequestTimedOutError()))
    assert seen == []
    [line] = [r for r in caplog.records if r.name == "outbox.daemon"]
    assert line.levelno == logging.DEBUG and "RequestTimedOutError" in line.getMessage()


def test_our_own_tasks_kafka_error_keeps_asyncios_report() -> None:
    # A future or task of the daemons' own must never go quiet: it is a bug to fix.
    seen = _unretrieved(_ours(RequestTimedOutError()))
    assert [c["exception"].__class__ for c in seen] == [RequestTimedOutError]


def test_an_aiokafka_tasks_other_error_keeps_asyncios_report() -> None:
    seen = _unretrieved(_aiokafka_style(KeyError("bug")))
    assert [c["exception"].__class__ for c in seen] == [KeyError]
