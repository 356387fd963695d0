"""The daemons' loop report (outbox/aio.py): aiokafka's shielded offset commit, failing
after a bounded stop gave it up, is one DEBUG line; anything else keeps asyncio's report."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

import pytest
from aiokafka.errors import RequestTimedOutError

from outbox import aio


class GroupCoordinator:
    # Named as aiokafka's: the coroutine's qualified name is what the report looks at.
    async def _do_commit_offsets(self, exc: BaseException) -> None:
        raise exc


async def _ours(exc: BaseException) -> None:
    raise exc


def _unretrieved(coro: Coroutine[Any, Any, None]) -> list[dict[str, Any]]:
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


def test_a_shielded_commits_kafka_error_is_one_debug_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, "outbox.daemon")
    assert _unretrieved(GroupCoordinator()._do_commit_offsets(RequestTimedOutError())) == []
    [line] = [r for r in caplog.records if r.name == "outbox.daemon"]
    assert line.levelno == logging.DEBUG and "RequestTimedOutError" in line.getMessage()


def test_any_other_tasks_kafka_error_keeps_asyncios_report() -> None:
    # A task of the daemons' own must never go quiet: an unread error there is a bug.
    seen = _unretrieved(_ours(RequestTimedOutError()))
    assert [c["exception"].__class__ for c in seen] == [RequestTimedOutError]


def test_the_shielded_commits_other_errors_keep_asyncios_report() -> None:
    seen = _unretrieved(GroupCoordinator()._do_commit_offsets(KeyError("bug")))
    assert [c["exception"].__class__ for c in seen] == [KeyError]
