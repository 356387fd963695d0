"""PostgreSQL fails over (issue 48): a primary and a synchronous standby of the test's own
(tests/support/replicas.py), ``outbox relay`` and ``outbox consume`` (subprocesses) on a
URL naming both servers with ``target_session_attrs=read-write``, a producer publishing a
steady ~200 events/s over 40 keys; the primary is stopped in immediate mode and the
standby promoted.

The table source and the WAL source with a failover slot synced to the standby (made by
``outbox wal setup`` alone, PostgreSQL 18) lose nothing: lost 0, duplicate effects 0,
out-of-order pairs per key 0, both daemons still running; the seconds from the promotion
to the first event applied after it are printed. Where the slot cannot come through — a
standby that does not sync slots (PostgreSQL 18), or PostgreSQL 15, which has no failover
slots — ``doctor`` says so before the failover, and the relay stops after it with one line
naming the failover (timeline change) and the last confirmed LSN, exit 2.

Also here: the daemons reach the primary through each multi-host form of the URL and name
it in their start lines, and ``doctor`` names each setting a standby lacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr
from sqlalchemy import Engine, text

from outbox import WalSlotMissing, migrate
from outbox.db import sync_engine
from outbox.settings import OutboxSettings
from tests.acceptance.conftest import ROOT, Cli, Daemons, relay_and_consumer
from tests.support.inbox import effect_verdict, until
from tests.support.relay import read_ids
from tests.support.replicas import Pair, ReplicasFailed, replicated_pair
from tests.support.steady import KEYS, SteadyProducer, effects

pytestmark = pytest.mark.acceptance


@dataclass
class Stream:
    pair: Pair
    settings: OutboxSettings
    cli: Cli
    engine: Engine
    effects: str
    producer: SteadyProducer
    daemons: Daemons | None = None
    setup_output: str = ""  # what `outbox wal setup` said

    def applied(self) -> int:
        try:
            with self.engine.connect() as conn:
                return int(conn.execute(text(f"SELECT count(*) FROM {self.effects}")).scalar_one())
        except Exception:
            return 0  # between the two servers: nothing known to be applied yet

    async def wait_applied(self, count: int, within: float) -> int:
        deadline = time.monotonic() + within
        seen = await asyncio.to_thread(self.applied)
        while seen < count and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            seen = await asyncio.to_thread(self.applied)
        return seen

    def first_applied_after(self, moment: float) -> float | None:
        """Seconds from ``moment`` (Unix time) to the first effect applied after it."""
        with self.engine.connect() as conn:
            first = conn.execute(
                text(
                    f"SELECT extract(epoch FROM min(applied_at)) FROM {self.effects}"
                    " WHERE applied_at > to_timestamp(:t)"
                ),
                {"t": moment},
            ).scalar_one()
        return None if first is None else float(first) - moment

    def log(self, name: str) -> str:
        assert self.daemons is not None
        return self.daemons.logs[name].read_text(errors="replace")

    def dump(self) -> str:
        daemons = self.daemons.dump() if self.daemons else ""
        return f"{daemons}\n{self.pair.dump()}\nproducer errors: {self.producer.errors[:5]}"


def _pair(version: int, **kwargs: Any) -> Any:
    try:
        return replicated_pair(version, **kwargs)
    except ReplicasFailed as exc:
        pytest.fail(str(exc), pytrace=False)


@contextmanager
def _stream(
    pair: Pair, source: str, kafka_bootstrap: str, tmp_path: Path, **env: str
) -> Iterator[Stream]:
    """Tables migrated, topics made, the producer ready, the daemons not started yet."""
    settings = OutboxSettings(
        database_url=SecretStr(pair.url()),
        kafka_bootstrap_servers=kafka_bootstrap,
        source=source,  # type: ignore[arg-type]
    )
    migrate.upgrade(settings)
    engine = sync_engine(settings, pool_size=2)
    made = effects(engine, tmp_path, "failover", pad=False)
    topic, module = made.topic, made.module
    cli = Cli(
        settings,
        (
            *made.cli_env(tmp_path, ROOT),
            ("OUTBOX_SOURCE", source),
            ("OUTBOX_WAL__HEARTBEAT_SECONDS", "1"),
            ("OUTBOX_WAL__STANDBY_URLS", pair.standby.url()),
            *env.items(),
        ),
    )
    producer = SteadyProducer(settings, topic)
    s = Stream(pair, settings, cli, engine, made.table, producer)
    try:
        if source == "wal":
            done = cli("wal", "setup")
            assert done.returncode == 0, done.stdout + done.stderr
            s.setup_output = done.stderr
        with relay_and_consumer(cli, f"{module}:app", topic, 4, tmp_path) as daemons:
            s.daemons = daemons
            yield s
    finally:
        producer.stop.set()
        engine.dispose()


def _doctor(cli: Cli) -> dict[str, list[dict[str, Any]]]:
    """doctor's findings by check (exit 0 or 1: the checks here are warnings)."""
    done = cli("doctor", "--json", "--no-kafka")
    assert done.returncode in (0, 1), done.stdout + done.stderr
    found: dict[str, list[dict[str, Any]]] = {}
    for f in json.loads(done.stdout):
        found.setdefault(f["check"], []).append(f)
    return found


async def _survives(s: Stream, label: str) -> None:
    """The stream goes through a failover: nothing lost, no duplicate effect, order kept,
    both daemons running; the seconds to the first event after the promotion printed."""
    s.producer.start()
    assert await s.wait_applied(400, 60) >= 400, s.dump()
    promoted_wall = s.pair.failover()
    await asyncio.sleep(6)  # the stream goes on against the new primary
    published = s.producer.finish()
    applied = await s.wait_applied(published, 90)
    await asyncio.sleep(1)  # anything still arriving would be a duplicate
    with s.engine.connect() as conn:
        found = conn.execute(text(f"SELECT event_id, key, seq FROM {s.effects} ORDER BY id"))
        rows = [(str(e), str(k), int(q)) for e, k, q in found]
    lost, duplicates, out_of_order = effect_verdict(rows, published)
    first = s.first_applied_after(promoted_wall)
    figures = (
        f"{label}: published {published}, applied {applied}; lost {lost}, duplicate effects "
        f"{duplicates}, out of order {out_of_order}; first event applied "
        f"{first if first is None else round(first, 2)} s after the promotion; producer "
        f"errors {len(s.producer.errors)}"
    )
    print(figures)
    if lost:
        figures += await _missing(s, rows, published)
    assert (lost, duplicates, out_of_order) == (0, 0, 0), figures + s.dump()
    assert first is not None, figures + s.dump()
    assert s.daemons is not None and s.daemons.alive(), figures + s.dump()


async def _missing(s: Stream, rows: list[tuple[str, str, int]], published: int) -> str:
    """Which events were not applied, and whether Kafka has them (for the post-mortem)."""
    seen = {(key, seq) for _, key, seq in rows}
    gone = [n for n in range(published) if (f"key-{n % KEYS}", n // KEYS) not in seen]
    ids = [str(uuid.uuid5(uuid.NAMESPACE_URL, f"{s.producer.topic}/{n}")) for n in gone]
    records = await read_ids(s.settings.kafka_bootstrap_servers, s.producer.topic, ids, 10)
    in_kafka = {r.headers["ce_id"].decode() for r in records} & set(ids)
    return f"; not applied: n={gone[:20]}, of which in Kafka: {len(in_kafka)}"


async def _relay_stops(s: Stream, label: str) -> str:
    """After the failover the relay stops, exit 2, with one line naming it; the line."""
    s.producer.start()
    assert await s.wait_applied(200, 60) >= 200, s.dump()
    s.pair.failover()
    assert s.daemons is not None
    relay = s.daemons.procs["relay"]
    code = await asyncio.to_thread(relay.wait, 60)
    # The producer fails closed on the new primary (no slot there: issue 51): refused with
    # WalSlotMissing, not committed for no slot to read.
    refused = await until(lambda: any(isinstance(e, WalSlotMissing) for e in s.producer.errors), 20)
    s.producer.finish()
    log = s.log("relay")
    lines = [line for line in log.splitlines() if "may be lost" in line]
    print(f"{label}: relay exit {code}: {lines[-1] if lines else '(no line)'}")
    assert code == 2, log[-3000:] + s.dump()
    assert len(lines) == 1, log[-3000:]
    line = lines[0]
    assert "failover (timeline 1 -> 2" in line, line
    assert "since LSN " in line and "(its confirmed LSN is unknown)" not in line, line
    assert "Traceback" not in log
    assert s.daemons.procs["consumer"].poll() is None, s.dump()
    assert refused, f"no WalSlotMissing after the failover: {s.producer.errors[-5:]}"
    return line


def _levels(found: dict[str, list[dict[str, Any]]], check: str) -> list[str]:
    return [f["level"] for f in found.get(check, [])]


async def test_the_table_source_loses_nothing_across_a_failover(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    with _pair(18) as pair, _stream(pair, "table", kafka_bootstrap, tmp_path) as s:
        await _survives(s, "table source, PostgreSQL 18")


async def test_the_wal_source_with_a_synced_failover_slot_loses_nothing(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    with _pair(18) as pair, _stream(pair, "wal", kafka_bootstrap, tmp_path) as s:
        assert "is a failover slot" in s.setup_output, s.setup_output
        s.producer.start()
        t0 = time.monotonic()
        done = await asyncio.to_thread(s.cli, "wal", "setup", "--wait-synced", "--timeout", "120")
        assert done.returncode == 0, done.stdout + done.stderr + s.dump()
        assert "synced on" in done.stderr, done.stderr
        print(f"slot synced to the standby {time.monotonic() - t0:.1f} s after the relay started")
        found = _doctor(s.cli)
        for check in ("wal_failover_slot", "synchronized_standby_slots", "standby_streaming"):
            assert _levels(found, check) == ["ok"], found.get(check)
        for check in (
            "standby_sync_replication_slots",
            "standby_hot_standby_feedback",
            "standby_primary_slot_name",
            "standby_dbname",
            "standby_slot_synced",
        ):
            assert _levels(found, check) == ["ok"], found.get(check)
        await _survives(s, "WAL source, synced failover slot, PostgreSQL 18")
        assert "timeline" not in s.log("relay").lower() or "lost" not in s.log("relay")


async def test_a_failover_slot_not_synced_stops_the_relay_with_one_line(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    omit = frozenset({"sync_replication_slots"})
    with _pair(18, omit=omit) as pair, _stream(pair, "wal", kafka_bootstrap, tmp_path) as s:
        found = _doctor(s.cli)
        sync = found["standby_sync_replication_slots"][0]
        assert sync["level"] == "warn" and "sync_replication_slots" in sync["what"], sync
        assert "a promotion now loses" in found["standby_slot_synced"][0]["what"], found
        await _relay_stops(s, "WAL source, failover slot not synced, PostgreSQL 18")


async def test_postgresql_15_says_a_failover_loses_the_slot_and_the_relay_stops(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    with _pair(15) as pair, _stream(pair, "wal", kafka_bootstrap, tmp_path) as s:
        said = s.setup_output
        assert "PostgreSQL 15 has no failover slots" in said and "table source" in said, said
        found = _doctor(s.cli)
        (warning,) = found["wal_failover"]
        assert warning["level"] == "warn" and "no failover slots" in warning["what"], warning
        assert "since its confirmed LSN" in warning["what"], warning
        await _relay_stops(s, "WAL source, PostgreSQL 15")


# -- multi-host URLs and the standby's settings, on one pair --------------------------------


@pytest.fixture(scope="module")
def pair18() -> Iterator[Pair]:
    with _pair(18) as pair:
        yield pair


async def test_the_daemons_reach_the_primary_through_each_multi_host_form(
    pair18: Pair, kafka_bootstrap: str, tmp_path: Path
) -> None:
    # The standby first: target_session_attrs=read-write must pass it by. The three forms'
    # daemons run at once (each its own schema and topic).
    p, st = pair18.primary, pair18.standby
    forms = {
        "list": f"host=127.0.0.1,127.0.0.1&port={st.port},{p.port}",
        "repeated": f"host={st.host}&host={p.host}",
        "pairs": f"host={st.host},{p.host}",
    }
    want = f"127.0.0.1:{p.port} (primary)"
    with contextlib.ExitStack() as stack:
        running = {}
        for form, hosts in forms.items():
            url = (
                f"postgresql+psycopg://outbox@/outbox?{hosts}"
                "&target_session_attrs=read-write&sslmode=disable"
            )
            settings = OutboxSettings(
                database_url=SecretStr(url),
                kafka_bootstrap_servers=kafka_bootstrap,
                db_schema=f"acc_{uuid.uuid4().hex[:10]}",
            )
            migrate.upgrade(settings)
            topic = f"multihost-{form}-{uuid.uuid4().hex[:8]}"
            logs = tmp_path / form
            logs.mkdir()
            (logs / f"multihost_{form}.py").write_text(
                f"import inbox\napp = inbox.Consumer(name={topic!r}, topics=[{topic!r}])\n"
                "@app.handler('test.event')\nasync def h(event, session):\n    pass\n"
            )
            env = (("PYTHONPATH", f"{logs}:{ROOT}"), ("OUTBOX_LOG_LEVEL", "INFO"))
            cli = Cli(settings, env)
            app = f"multihost_{form}:app"
            running[form] = stack.enter_context(relay_and_consumer(cli, app, topic, 1, logs))

        def started() -> bool:
            return all(
                want in path.read_text(errors="replace")
                for daemons in running.values()
                for path in daemons.logs.values()
            )

        ok = await until(started, 90)
        dumps = "\n".join(f"=== {form}\n{d.dump()}" for form, d in running.items())
        assert ok, dumps
        for form, daemons in running.items():
            assert daemons.alive(), f"{form}\n{dumps}"
            start_line = next(
                line
                for line in daemons.logs["relay"].read_text().splitlines()
                if "relay starting" in line
            )
            assert f"server={want}" in start_line, (form, start_line)


def test_doctor_names_each_setting_a_standby_lacks(pair18: Pair, kafka_bootstrap: str) -> None:
    settings = OutboxSettings(
        database_url=SecretStr(pair18.url()),
        kafka_bootstrap_servers=kafka_bootstrap,
        db_schema=f"acc_{uuid.uuid4().hex[:10]}",
        source="wal",
    )
    migrate.upgrade(settings)
    cli = Cli(
        settings,
        (("OUTBOX_SOURCE", "wal"), ("OUTBOX_WAL__STANDBY_URLS", pair18.standby.url())),
    )
    done = cli("wal", "setup")
    assert done.returncode == 0, done.stdout + done.stderr
    standby = pair18.standby
    found = _doctor(cli)
    ready = [
        "standby_sync_replication_slots",
        "standby_hot_standby_feedback",
        "standby_primary_slot_name",
        "standby_dbname",
    ]
    assert [_levels(found, c) for c in ready] == [["ok"]] * 4, found
    # Each setting slot sync needs, taken away on the standby (all reloadable): doctor
    # names every one.
    (conninfo,) = standby.query("SHOW primary_conninfo")[0]
    without_dbname = " ".join(p for p in conninfo.split() if not p.startswith("dbname="))
    bad = {
        "sync_replication_slots": ("off", "standby_sync_replication_slots", "sync_replication"),
        "hot_standby_feedback": ("off", "standby_hot_standby_feedback", "hot_standby_feedback"),
        "primary_slot_name": ("", "standby_primary_slot_name", "primary_slot_name"),
        "primary_conninfo": (without_dbname, "standby_dbname", "dbname"),
    }  # fmt: skip
    originals = {name: standby.query(f"SHOW {name}")[0][0] for name in bad}
    try:
        for name, (value, _, _) in bad.items():
            _set(standby, name, value)
        found = _doctor(cli)
    finally:
        for name, value in originals.items():
            _set(standby, name, value)
    for _, check, named in bad.values():
        (finding,) = found[check]
        assert finding["level"] == "warn" and named in finding["what"], finding


def _set(node: Any, name: str, value: str) -> None:
    quoted = "'" + value.replace("'", "''") + "'"
    node.query(f"ALTER SYSTEM SET {name} = {quoted}")
    node.query("SELECT pg_reload_conf()")
    deadline = time.monotonic() + 10
    while node.query(f"SHOW {name}")[0][0] != value and time.monotonic() < deadline:
        time.sleep(0.1)


def test_setup_turns_failover_on_for_an_existing_slot_unless_it_is_streamed(
    pair18: Pair, kafka_bootstrap: str
) -> None:
    slot = f"plain_{uuid.uuid4().hex[:8]}"
    settings = OutboxSettings(
        database_url=SecretStr(pair18.url()),
        kafka_bootstrap_servers=kafka_bootstrap,
        source="wal",
        wal={"slot": slot, "publication": slot},  # type: ignore[arg-type]
    )
    cli = Cli(settings, (("OUTBOX_SOURCE", "wal"), ("OUTBOX_WAL__SLOT", slot)))
    p = pair18.primary

    def failover() -> bool:
        return bool(
            p.query("SELECT failover FROM pg_replication_slots WHERE slot_name = %s", [slot])[0][0]
        )

    # A slot made before (by hand, or by an older `outbox wal setup`): no failover flag.
    p.query(f'CREATE PUBLICATION "{slot}"')
    p.query("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", [slot])
    try:
        # Streamed by another session: PostgreSQL refuses, and setup says so.
        reader = subprocess.Popen(
            [str(p.bin / "pg_recvlogical"), "-d", p.libpq(), "--slot", slot, "--start",
             "-o", "proto_version=1", "-o", f"publication_names={slot}", "-f", "/dev/null"],
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 20
            while not p.query(
                "SELECT active FROM pg_replication_slots WHERE slot_name = %s", [slot]
            )[0][0]:
                assert time.monotonic() < deadline, "pg_recvlogical never streamed the slot"
                time.sleep(0.1)
            done = cli("wal", "setup")
        finally:
            reader.terminate()
            reader.wait(10)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "could not be made one" in done.stderr and "active" in done.stderr, done.stderr
        assert not failover()
        # Nobody streams it: turned on.
        deadline = time.monotonic() + 20
        while p.query("SELECT active FROM pg_replication_slots WHERE slot_name = %s", [slot])[0][0]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        done = cli("wal", "setup")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "turned failover on" in done.stderr, done.stderr
        assert failover()
    finally:
        p.query("SELECT pg_drop_replication_slot(%s)", [slot])
        p.query(f'DROP PUBLICATION "{slot}"')
