"""Failover logic without a server: multi-host URLs (outbox/dsn.py), doctor's failover
findings (outbox/ops/wal_failover.py) and the relay's verdict after a reconnection
(relay/sources/wal/failover.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from psycopg.conninfo import conninfo_to_dict
from pydantic import SecretStr
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

from outbox.dsn import MultiHostError, hosts_and_ports, normalized
from outbox.errors import ConfigurationError
from outbox.ops.wal_failover import PrimaryView, Standby, StandbyView, findings
from outbox.ops.wal_slot import SlotState
from outbox.settings import OutboxSettings, load_settings
from relay.errors import SlotMissing
from relay.sources.wal.failover import Seen, lost_in_failover

BASE = "postgresql+psycopg://u:p%40ss@/app?target_session_attrs=read-write&"
FORMS = {
    "list": "host=a,b&port=5432,5433",
    "repeated": "host=a:5432&host=b:5433",
    "pairs": "host=a:5432,b:5433",
}


@pytest.mark.parametrize("form", FORMS)
def test_every_multi_host_form_reaches_libpq_and_sqlalchemy_whole(form: str) -> None:
    s = OutboxSettings(database_url=SecretStr(BASE + FORMS[form]))
    dsn = conninfo_to_dict(s.libpq_dsn)
    assert (dsn["host"], dsn["port"], dsn["password"]) == ("a,b", "5432,5433", "p@ss")
    assert dsn["target_session_attrs"] == "read-write"
    engine = create_engine(s.sqlalchemy_url)
    _, kwargs = engine.dialect.create_connect_args(engine.url)
    assert (kwargs["host"], kwargs["port"]) == ("a,b", "5432,5433")
    assert "host=a,b&port=5432,5433" in s.safe_database_url and "p%40ss" not in s.safe_database_url


def test_one_host_urls_are_left_as_they_are() -> None:
    url = make_url("postgresql+psycopg://u:p@db:6432/app?sslmode=require")
    assert normalized(url) == url
    assert hosts_and_ports(url) == [("db", "6432")]
    assert hosts_and_ports(make_url("postgresql+psycopg://u@/app?host=/run/pg")) == [
        ("/run/pg", "")
    ]


def test_hosts_and_ports_that_do_not_pair_up_are_a_settings_error() -> None:
    with pytest.raises(MultiHostError):
        hosts_and_ports(make_url("postgresql+psycopg://u@/app?host=a,b,c&port=1,2"))
    with pytest.raises(ConfigurationError, match="database_url: give each host's port once"):
        load_settings(database_url="postgresql+psycopg://u@/app?host=a:1,b&port=2,3")


def test_standby_urls_are_split_on_spaces_or_read_as_json() -> None:
    a, b = "postgresql+psycopg://u@/app?host=x,y", "postgresql+psycopg://u@z/app"
    for raw in (f"{a} {b}", f'["{a}", "{b}"]'):
        got = load_settings(wal={"standby_urls": raw}).wal.standby_urls
        assert [u.get_secret_value() for u in got] == [a, b]


SLOT = SlotState(
    "outbox_relay", "pgoutput", "logical", "app", True, 1, "reserved", None, "0/10", "0/20",
    "0/30", 32, 16, failover=True, synced=False,
)  # fmt: skip
PRIMARY = PrimaryView(
    180000, False, "standby1_slot", (Standby("standby1", "streaming", "sync", "standby1_slot"),),
    ("standby1_slot",),
)  # fmt: skip
GOOD = StandbyView(
    "postgresql+psycopg://m@b/app", None, True, 180000, "on", "on", "standby1_slot",
    "host=a dbname=app", {"synced": True, "temporary": False, "confirmed_flush_lsn": "0/20"},
)  # fmt: skip
WAL = OutboxSettings(source="wal", wal={"standby_urls": [GOOD.url]})  # type: ignore[arg-type]


def levels(found: list) -> dict[str, str]:  # type: ignore[type-arg]
    return {f.check: f.level for f in found}


def test_a_ready_pair_is_ok_in_every_check() -> None:
    got = levels(findings(PRIMARY, SLOT, [GOOD], WAL))
    assert set(got.values()) == {"ok"}, got
    assert len(got) == 8


@pytest.mark.parametrize(
    ("change", "check", "named"),
    [
        ({"sync_replication_slots": "off"}, "standby_sync_replication_slots", "sync_repl"),
        ({"hot_standby_feedback": "off"}, "standby_hot_standby_feedback", "hot_standby_feedback"),
        ({"primary_slot_name": ""}, "standby_primary_slot_name", "primary_slot_name"),
        ({"primary_conninfo": "host=a"}, "standby_dbname", "dbname"),
        ({"slot": None}, "standby_slot_synced", "a promotion now loses the slot"),
        ({"slot": {"synced": True, "temporary": True}}, "standby_slot_synced", "not synced yet"),
    ],
)  # fmt: skip
def test_each_missing_standby_setting_is_named(change: dict, check: str, named: str) -> None:  # type: ignore[type-arg]
    found = {f.check: f for f in findings(PRIMARY, SLOT, [replace(GOOD, **change)], WAL)}
    assert found[check].level == "warn" and named in found[check].what, found[check]
    assert [c for c, f in found.items() if f.level != "ok"] == [check]


def test_the_primary_side_and_postgresql_before_17() -> None:
    bare = replace(PRIMARY, synchronized_standby_slots="", standbys=())
    got = {f.check: f for f in findings(bare, replace(SLOT, failover=False), [GOOD], WAL)}
    assert got["wal_failover_slot"].level == "warn"
    assert got["synchronized_standby_slots"].level == "warn"
    assert got["standby_streaming"].level == "warn"
    old = findings(replace(PRIMARY, version_num=150004), SLOT, [], WAL)
    assert [(f.check, f.level) for f in old] == [("wal_failover", "warn")]
    assert "0/20" in old[0].what and "table source" in (old[0].action or "")


def test_the_relay_stops_only_when_a_failover_lost_the_slot() -> None:
    before = Seen(1, "0/20")
    assert lost_in_failover("s", None, 2, None) is None  # nothing seen before: not known
    assert lost_in_failover("s", before, 1, None) is None  # same timeline: dropped, not this
    assert lost_in_failover("s", before, 2, replace(SLOT, synced=True)) is None  # came through
    gone = lost_in_failover("s", before, 2, None)
    assert gone is not None and "failover (timeline 1 -> 2)" in str(gone)
    assert "since LSN 0/20" in str(gone) and "no slot s" in str(gone)
    made_since = lost_in_failover("s", before, 2, replace(SLOT, synced=False))
    assert made_since is not None and "not synced from the old" in str(made_since)


def test_a_missing_slot_on_a_promoted_server_says_it_may_have_been_lost_in_a_failover() -> None:
    assert "failover" not in str(SlotMissing("s", 1)) and "failover" not in str(SlotMissing("s"))
    assert "timeline 3: if it was promoted since the slot was made" in str(SlotMissing("s", 3))
