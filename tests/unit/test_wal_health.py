"""The WAL source's health from the slot's state (pure): doctor's classification of
wal_status, retention and leftovers, the gauges, the lag thresholds, the admin SQL and the
pgoutput BEGIN parser. Invalidating a real slot needs max_slot_wal_keep_size lowered on the
server, which would invalidate every other slot on the shared test server: the lost and
unreserved states are classified here from the query's result instead."""

from __future__ import annotations

import struct
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from outbox.ops.lag import LagReport, Thresholds, WalLag
from outbox.ops.wal_health import WalGauges, findings
from outbox.ops.wal_lag import commit_time
from outbox.ops.wal_slot import (
    READER_APPLICATION,
    ServerWal,
    SlotState,
    WalReader,
    WalState,
    setup_sql,
)
from outbox.sessions import relay_application
from outbox.settings import OutboxSettings

GIB = 1 << 30
WAL = OutboxSettings(source="wal")
SERVER = ServerWal("logical", -1, "app", "app_owner", True, True)
SLOT = SlotState(
    slot_name="outbox_relay",
    plugin="pgoutput",
    slot_type="logical",
    database="app",
    active=False,
    active_pid=None,
    wal_status="reserved",
    safe_wal_size=None,
    restart_lsn="0/1000000",
    confirmed_flush_lsn="0/1000100",
    current_lsn="0/2000000",
    retained_bytes=16 << 20,
    unconfirmed_bytes=(16 << 20) - 256,
)


def state(slot: SlotState | None = SLOT, server: ServerWal = SERVER) -> WalState:
    return WalState(server=server, slot=slot, publication_exists=True)


def by_check(s: WalState, settings: OutboxSettings = WAL) -> dict[str, tuple[str, str, str]]:
    found = findings(s, settings)
    checks = [f.check for f in found]
    assert len(checks) == len(set(checks)), checks  # one finding per check
    return {f.check: (f.level, f.what, f.action or "") for f in found}


def test_a_healthy_slot_under_unbounded_retention_warns_about_the_bound_only() -> None:
    found = by_check(state())
    assert found["wal_slot"][0] == "ok" and found["wal_publication"][0] == "ok"
    level, what, action = found["wal_retention"]
    assert level == "warn" and "unbounded" in what and "max_slot_wal_keep_size" in action


def test_a_lost_slot_is_an_error_naming_the_lsn_since_which_events_may_be_lost() -> None:
    lost = replace(SLOT, wal_status="lost", restart_lsn=None, retained_bytes=None)
    level, what, action = by_check(state(lost))["wal_slot"]
    assert level == "error" and "lost" in what
    assert "since LSN 0/1000100" in action and "may be lost" in action
    assert "outbox_relay" in action and "outbox wal setup --recreate-lost" in action


def test_an_unreserved_slot_warns_that_the_next_checkpoint_may_invalidate_it() -> None:
    level, what, _ = by_check(state(replace(SLOT, wal_status="unreserved")))["wal_slot"]
    assert level == "warn" and "unreserved" in what and "checkpoint" in what


@pytest.mark.parametrize("status", ["reserved", "extended"])
def test_reserved_and_extended_are_fine(status: str) -> None:
    assert by_check(state(replace(SLOT, wal_status=status)))["wal_slot"][0] == "ok"


def test_bounded_retention_warns_when_little_room_is_left() -> None:
    bounded = replace(SERVER, max_slot_wal_keep_size=10 * GIB)
    roomy = state(replace(SLOT, safe_wal_size=9 * GIB), bounded)
    assert by_check(roomy)["wal_retention"][0] == "ok"
    tight = state(replace(SLOT, safe_wal_size=GIB), bounded)
    level, what, _ = by_check(tight)["wal_retention"]
    assert level == "warn" and "before it is invalidated" in what


def test_missing_slot_and_publication_and_wrong_wal_level_are_errors_in_wal_mode() -> None:
    s = WalState(replace(SERVER, wal_level="replica"), None, publication_exists=False)
    found = by_check(s)
    assert found["wal_level"][0] == "error" and "wal_level = logical" in found["wal_level"][2]
    assert found["wal_slot"][0] == "error" and "does not exist" in found["wal_slot"][1]
    assert found["wal_publication"][0] == "error"


@pytest.mark.parametrize(
    ("slot", "why"),
    [
        (replace(SLOT, slot_type="physical", plugin=None), "physical"),
        (replace(SLOT, plugin="test_decoding"), "test_decoding"),
        (replace(SLOT, database="other"), "database other"),
    ],
)
def test_a_slot_that_is_not_this_databases_pgoutput_slot_is_an_error(
    slot: SlotState, why: str
) -> None:
    level, what, _ = by_check(state(slot))["wal_slot"]
    assert level == "error" and why in what


@pytest.mark.parametrize("plugin", ["", None])
def test_a_slot_another_session_is_creating_is_a_warning_not_a_foreign_slot(
    plugin: str | None,
) -> None:
    # PostgreSQL lists a logical slot before its creation has written the plugin's name.
    slot = replace(SLOT, plugin=plugin, active=True, active_pid=4242)
    assert slot.being_created and not SLOT.being_created
    level, what, action = by_check(state(slot))["wal_slot"]
    assert level == "warn" and "being created" in what and "doctor again" in action


def test_a_slot_left_behind_in_table_mode_is_a_warning() -> None:
    level, what, action = by_check(state(), OutboxSettings(source="table"))["wal_slot"]
    assert level == "warn" and "nobody reads it" in what and "pg_drop_replication_slot" in action


def test_gauges() -> None:
    assert WalGauges.of(None, None) == WalGauges(-1, -1, -1, -1, -1)
    g = WalGauges.of(replace(SLOT, wal_status="unreserved", safe_wal_size=GIB), 2.5)
    assert g == WalGauges(16 << 20, (16 << 20) - 256, 2.5, 2, GIB)
    lost = WalGauges.of(replace(SLOT, wal_status="lost", retained_bytes=None), None)
    assert (lost.slot_status, lost.retained_bytes, lost.lag_seconds) == (3, -1, -1)


def breaches(limits: Thresholds, wal: WalLag) -> list[str]:
    report = LagReport(taken_at=datetime.now(UTC), mode="delete", lanes=1, wal=wal)
    return limits.breaches(report)


def test_lag_thresholds_cover_the_slot_and_never_pass_an_unknown_figure() -> None:
    wal = WalLag("outbox_relay", True, retained_bytes=5 * GIB, lag_seconds=90.0)
    limits = Thresholds(max_age_seconds=60, max_wal_bytes=GIB)
    assert breaches(limits, wal) == [
        "WAL slot outbox_relay: oldest unconfirmed transaction is 90.0s old (limit 60s)",
        f"WAL slot outbox_relay retains {5 * GIB} bytes of WAL (limit {GIB})",
    ]
    assert breaches(Thresholds(max_age_seconds=120, max_wal_bytes=10 * GIB), wal) == []
    unknown = WalLag("outbox_relay", False, lag_unknown="no such slot")
    assert breaches(limits, unknown) == [
        "WAL slot outbox_relay: lag unknown (no such slot)",
        "WAL slot outbox_relay: retained WAL unknown (missing or lost)",
    ]
    assert breaches(Thresholds(), unknown) == []


def test_setup_sql_creates_the_publication_before_the_slot_and_is_idempotent() -> None:
    sql = setup_sql(WAL, "app", "billing_relay")
    lines = [x for x in sql.splitlines() if not x.startswith("--")]
    assert len(lines) == 3  # one statement per line: psql -f runs each in its own transaction
    assert "CREATE PUBLICATION" in lines[0] and "duplicate_object" in lines[0]
    assert "pg_create_logical_replication_slot('outbox_relay', 'pgoutput')" in lines[1]
    assert "IF NOT EXISTS" in lines[1]
    # A failover slot where the server has them (17+), decided by the server itself.
    assert "'pgoutput', false, false, true)" in lines[1] and "170000" in lines[1]
    assert lines[2] == 'ALTER ROLE "billing_relay" WITH REPLICATION;'
    assert "ALTER ROLE" not in "".join(
        x for x in setup_sql(WAL).splitlines() if not x.startswith("--")
    )


def test_commit_time_reads_pgoutputs_begin_message() -> None:
    when = datetime(2026, 11, 27, 4, 2, 21, 564660, tzinfo=UTC)
    micros = int((when - datetime(2000, 1, 1, tzinfo=UTC)).total_seconds() * 1_000_000)
    begin = struct.pack("!cqqi", b"B", 0x2628DCD78, micros, 1234)
    assert commit_time(begin) == when
    assert commit_time(b"M" + begin[1:]) is None
    assert commit_time(begin[:-1]) is None


def test_the_operations_page_shows_the_admin_sql_as_printed() -> None:
    page = Path(__file__).resolve().parents[2] / "docs" / "operations" / "wal-slot.md"
    printed = setup_sql(OutboxSettings(), "app", "billing_relay", ["billing_app"])
    command = "$ outbox wal setup --print-sql --role billing_relay --producer-role billing_app"
    assert f"{command}\n{printed}```" in page.read_text()


def test_doctor_says_whether_a_relay_reads_the_slot() -> None:
    nobody = by_check(replace(state(), readers=(WalReader(41, False),)))["wal_reader"]
    assert nobody[0] == "warn" and "no relay reads the slot (1 connected" in nobody[1]
    readers = (
        WalReader(40, True, relay_application(READER_APPLICATION, 1234, "relay-a")),
        WalReader(41, False, relay_application(READER_APPLICATION, 1235, "relay-b")),
        WalReader(42, False),  # a relay from before they named themselves
    )
    reading = by_check(replace(state(), readers=readers))
    assert reading["wal_reader"][:2] == (
        "ok",
        "a relay reads the slot: relay pid 1234 on relay-a (backend pid 40); 2 standing by",
    )
    # The old form (the backend only) still reads.
    old = by_check(replace(state(), readers=readers[2:]))["wal_reader"]
    assert old[0] == "warn" and "1 connected" in old[1]
    old = by_check(replace(state(), readers=(WalReader(42, True),)))["wal_reader"]
    assert old[1] == "a relay reads the slot: backend pid 42; 0 standing by"
    assert "wal_reader" not in by_check(state(), OutboxSettings(source="table"))
    assert "wal_reader" not in by_check(state(slot=None))  # the missing slot is the error


def test_public_may_emit_is_an_error_in_wal_mode_only() -> None:
    open_door = replace(state(), emit_public=True)
    level, what, action = by_check(open_door)["wal_emit"]
    assert level == "error" and "forge" in what and "--producer-role" in action
    assert by_check(state())["wal_emit"][0] == "ok"
    table = OutboxSettings(source="table")
    assert "wal_emit" not in by_check(open_door, table)


def test_the_setup_sql_restricts_emitting_only_when_producer_roles_are_given() -> None:
    plain = setup_sql(WAL, "app", "billing_relay")
    assert "FROM PUBLIC" not in plain and "--producer-role" in plain
    script = setup_sql(WAL, "app", "billing_relay", ["billing_app", "o'dd"])
    [block] = [line for line in script.splitlines() if "FROM PUBLIC" in line]
    # Named roles unconditionally (a misspelt one fails the block), the job roles if they
    # exist, the runner, then the revoke: all in one loop over every signature.
    assert block.index("'billing_app'") < block.index("'o''dd'") < block.index("current_user")
    assert "'billing_relay'" in block
    assert "IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_producer')" in block
    assert "rolname = 'outbox_relay'" in block
    assert block.index("current_user") < block.index("REVOKE")
    assert block.startswith("DO $$") and block.endswith("END $$;")


def test_in_table_mode_a_slot_being_read_is_not_advised_for_dropping() -> None:
    table = OutboxSettings(source="table")
    reader = WalReader(40, True, relay_application(READER_APPLICATION, 1234, "relay-a"))
    read = by_check(replace(state(), readers=(reader,)), table)["wal_slot"]
    assert read[0] == "ok" and "being read by relay pid 1234 on relay-a (backend pid 40)" in read[1]
    assert "drop" not in read[2].lower()
    streamed = by_check(state(replace(SLOT, active=True, active_pid=77)), table)["wal_slot"]
    assert streamed[0] == "ok" and "being read by walsender pid 77:" in streamed[1]
    idle = by_check(state(), table)["wal_slot"]
    assert idle[0] == "warn" and "pg_drop_replication_slot" in idle[2]
