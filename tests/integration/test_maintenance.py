"""Maintenance and registration, whatever the source (issue 46): a WAL relay registers with
its process id and runs retention like a table relay; one relay of a deployment runs the
maintenance services, and another takes them over when it is killed."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import psycopg
import pytest
from sqlalchemy import Engine, func, text

from outbox.settings import OutboxSettings
from tests.support.console import console_process
from tests.support.relay import RelayProcess, outbox_cli, relay_env
from tests.support.retention import add_effects, add_idempotency, add_inbox, ago, counts
from tests.support.wal import wait_until, wal_env, wal_relay_env, wal_source

pytestmark = pytest.mark.integration


def _relays(s: OutboxSettings) -> list[dict[str, object]]:
    """The relays table's live rows (heartbeat within 2 s)."""
    with psycopg.connect(s.libpq_dsn) as conn:
        rows = conn.execute(
            f'SELECT pid, source, maintenance FROM "{s.db_schema}"."{s.table_prefix}relays"'
            " WHERE heartbeat_at > now() - interval '2 seconds' ORDER BY pid"
        ).fetchall()
    return [{"pid": pid, "source": source, "maintenance": lead} for pid, source, lead in rows]


@contextmanager
def _deployment(s: OutboxSettings, source: str) -> Iterator[tuple[OutboxSettings, dict[str, str]]]:
    """``s`` for ``source`` (a slot of its own for the WAL), and a relay's environment."""
    with ExitStack() as stack:
        if source == "wal":
            own = stack.enter_context(wal_source(s))
            yield own, wal_relay_env(own)
        else:
            yield s, relay_env(s)


def test_a_wal_relay_runs_retention_and_is_listed_with_its_pid(
    engine: Engine, isolated_settings: OutboxSettings, tmp_path: Path
) -> None:
    with wal_source(isolated_settings) as s:
        add_inbox(engine, s, 10, processed="2 days")
        add_inbox(engine, s, 5, processed="1 hour")
        add_idempotency(engine, s, 6, expires=ago("1 hour"))
        add_idempotency(engine, s, 3, expires=func.now() + text("interval '1 hour'"))
        add_effects(engine, s, 4, "done", expires=ago("1 hour"))
        add_effects(engine, s, 2, "done", expires=func.now() + text("interval '1 hour'"))
        env = wal_relay_env(
            s,
            OUTBOX_RELAY__CLEANUP_INTERVAL_SECONDS="0.5",
            OUTBOX_CONSUMER__DEDUPE_WINDOW_DAYS="1",
        )
        relay = RelayProcess(env, tmp_path, "wal")
        try:
            kept = {"inbox": 5, "idempotency": 3, "effects": 2}

            def cleaned() -> bool:
                now = counts(engine, s)
                return {k: now[k] for k in kept} == kept

            assert wait_until(cleaned, 30), (counts(engine, s), relay.log()[-3000:])
            assert "retention round" in relay.log()
            assert wait_until(lambda: _relays(s) == [_row(relay.pid, "wal", True)], 10), _relays(s)
            status = json.loads(outbox_cli("status", "--json", env=env).stdout)
            [listed] = status["relays"]
            assert (listed["pid"], listed["source"], listed["alive"]) == (relay.pid, "wal", True)
            assert listed["maintenance"] and status["totals"]["maintenance_relay"]
            lag = json.loads(outbox_cli("lag", "--json", "--no-kafka", env=env).stdout)
            assert [(r["pid"], r["source"]) for r in lag["relays"]] == [(relay.pid, "wal")]
            assert lag["totals"]["live_relays"] == 1 and lag["totals"]["unowned_lanes"] == 0
            # Who reads the slot: the relay's own process, its database session beside it.
            [backend] = lag["wal"]["reading_pids"]
            reader = f"relay pid {relay.pid} on {socket.gethostname()} (backend pid {backend})"
            assert lag["wal"]["reading"] == [reader], lag["wal"]
            assert f"read by {reader}" in outbox_cli("lag", "--no-kafka", env=env).stdout
            text_status = outbox_cli("status", env=env).stdout
            assert f"wal pid {relay.pid}" in text_status and "maintenance on" in text_status
            with console_process(s, **wal_env(s)) as (url, _):
                page = httpx.get(url + "/", timeout=30).text
            relays = page[page.index('<table id="relays">') :]
            relays = relays[: relays.index("</table>")]
            assert f'<td class="n">{relay.pid}</td><td>wal</td>' in relays, relays
            code, _ = relay.terminate()
            assert code == 0
        finally:
            relay.kill()


def _row(pid: int, source: str, lead: bool) -> dict[str, object]:
    return {"pid": pid, "source": source, "maintenance": lead}


@pytest.mark.parametrize("source", ["table", "wal"])
def test_maintenance_runs_on_one_relay_and_another_takes_it_over_when_it_is_killed(
    isolated_settings: OutboxSettings, tmp_path: Path, source: str
) -> None:
    with _deployment(isolated_settings, source) as (s, env):
        relays = [RelayProcess(env, tmp_path, f"{source}-{i}") for i in range(2)]
        try:
            by_pid = {r.pid: r for r in relays}

            def two_and_one_leader() -> bool:
                rows = _relays(s)
                return len(rows) == 2 and sum(bool(r["maintenance"]) for r in rows) == 1

            assert wait_until(two_and_one_leader, 60), [r.log()[-2000:] for r in relays]
            time.sleep(2)  # a while: still one, and the other never started the services
            rows = _relays(s)
            assert {r["source"] for r in rows} == {source}
            [leading] = [int(str(r["pid"])) for r in rows if r["maintenance"]]
            leader = by_pid[leading]
            [other] = [r for r in relays if r is not leader]
            said = "running the maintenance services"
            assert said in leader.log() and said not in other.log()
            leader.kill()  # SIGKILL: its sessions end, and the maintenance lock with them
            killed = time.monotonic()
            assert wait_until(lambda: _relays(s) == [_row(other.pid, source, True)], 20), (
                _relays(s),
                other.log()[-2000:],
            )
            took = time.monotonic() - killed
            print(f"{source}: maintenance moved to the other relay {took:.1f}s after SIGKILL")
            assert said in other.log()
            assert took < 10
        finally:
            for r in relays:
                r.kill()
