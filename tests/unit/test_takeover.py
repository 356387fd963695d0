"""Taking over from a frozen relay, the pure parts: which sessions are a relay's
(outbox/sessions.py, relay/takeover.py), when a relay may publish without asking its lock
session again (relay/fence.py), and the takeover setting's bound."""

from __future__ import annotations

import asyncio
import time

import psycopg
import pytest
from pydantic import ValidationError

from outbox.sessions import opened_by, relay_application
from outbox.settings import RelaySettings
from relay.fence import Fence, Stamp
from relay.fence import now as fence_now
from relay.takeover import silent_relays


def test_a_session_is_a_relays_only_under_its_exact_name() -> None:
    name = relay_application("outbox-relay-lanes", 4242, "relay-7")
    assert name == "outbox-relay-lanes 4242@relay-7"
    assert opened_by(name, 4242, "relay-7")
    assert not opened_by(name, 424, "relay-7")  # the query matches ' 424' too: not enough
    assert not opened_by(name, 4242, "relay-77")
    assert not opened_by("outbox-relay-lanes", 4242, "relay-7")  # a relay of before
    # A long host name is cut at 63 bytes by PostgreSQL: still recognised, exactly.
    host = "h" * 80
    cut = relay_application("outbox-relay-wal-stream", 17, host)
    assert len(cut.encode()) == 63 and opened_by(cut, 17, host)


def test_silent_relays_keep_only_the_sessions_they_opened() -> None:
    rows: list[tuple[str, str, int, float, int, str, float | None]] = [
        ("a", "relay-7", 42, 12.5, 900, "outbox-relay-lanes 42@relay-7", 12.5),
        ("a", "relay-7", 42, 12.5, 901, "outbox-relay-0 42@relay-7", 11.0),
        ("a", "relay-7", 42, 12.5, 902, "outbox-relay-0 4242@relay-7", 12.0),  # another relay
        ("a", "relay-7", 42, 12.5, 904, "outbox-relay-wal-gauges 42@relay-7", 3.0),  # busy
        ("b", "relay-8", 7, 30.0, 903, "outbox-relay-wal 7@relay-8", 29.0),
        ("b", "relay-8", 7, 30.0, 905, "outbox-relay-wal-side 7@relay-8", None),  # hidden
    ]
    relays = {r.relay_id: r for r in silent_relays(rows, 10.0)}
    assert [b for b, _ in relays["a"].sessions] == [900, 901]
    assert [b for b, _ in relays["b"].sessions] == [903]
    assert (relays["a"].unseen, relays["b"].unseen) == (0, 1)
    assert (relays["b"].pid, relays["b"].hostname, relays["b"].silent_for) == (7, "relay-8", 30.0)


def ago(at: Stamp, seconds: float) -> Stamp:
    return at[0] - seconds, at[1] - seconds


def test_the_fence_asks_the_session_only_past_half_the_takeover_time() -> None:
    calls: list[float] = []

    async def prove() -> None:
        calls.append(time.monotonic())

    fence = Fence(10.0, prove, "the WAL slot")

    async def go() -> None:
        await fence.check()  # never answered: asks
        assert fence.proofs == 1
        await fence.check()  # just answered: goes
        assert fence.proofs == 1
        fence.forget()
        at = fence_now()
        fence.answered(ago(at, 4.9))
        assert fence.fresh(at)
        fence.answered(ago(at, 6))  # an older answer never moves the proof back
        assert fence.fresh(at)
        assert not fence.fresh(ago(at, -0.2))  # 5.1 s since the last answer was sent
        assert not fence.fresh((at[0], at[1] + 5.1))  # the wall clock saw a pause
        fence.forget()
        fence.answered(ago(at, 5.1))
        await fence.check()  # too long ago: asks again
        assert fence.proofs == 2
        fence.forget()
        assert not fence.fresh()

    asyncio.run(go())
    assert len(calls) == 2


def test_a_fence_whose_session_is_gone_raises_the_databases_error_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def prove() -> None:
        raise psycopg.OperationalError("terminating connection due to administrator command")

    fence = Fence(10.0, prove, "the WAL slot")
    fence.answered(ago(fence_now(), 30))  # frozen for 30 s
    with pytest.raises(psycopg.OperationalError, match="administrator command"):
        asyncio.run(fence.check())
    assert not fence.fresh()
    [line] = [r.getMessage() for r in caplog.records]
    assert "the session holding the WAL slot last answered 30." in line
    assert "publishes nothing more" in line and "OperationalError" in line


def test_the_takeover_time_is_at_least_three_heartbeats_and_outlasts_the_shutdown() -> None:
    assert RelaySettings().takeover_seconds == 10.0
    RelaySettings(heartbeat_seconds=2, takeover_seconds=6)
    assert RelaySettings(heartbeat_seconds=5).takeover_seconds == 15  # unset: follows
    assert RelaySettings(shutdown_grace_seconds=30).takeover_seconds == 31
    with pytest.raises(ValidationError, match="at least three heartbeats"):
        RelaySettings(heartbeat_seconds=5, takeover_seconds=10)
    with pytest.raises(ValidationError, match="shutdown_grace_seconds"):
        RelaySettings(shutdown_grace_seconds=12, takeover_seconds=10)
