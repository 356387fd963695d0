"""Sources (issue 46): what differs per ``OUTBOX_SOURCE`` lives in the relay's source package
(relay/sources/) and in the registry the other tools ask (outbox/sources.py), nowhere else;
and the registry answers each tool's question for each source."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from outbox.settings import OutboxSettings
from outbox.sources import SOURCES, TABLE, WAL, deployed, source_of

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("outbox", "relay", "inbox", "cli")
# Where a source may be named and told apart: the relay's sources, the registry, and the
# setting itself.
ALLOWED = ("relay/sources/", "outbox/sources.py", "outbox/settings.py")
# A comparison with a source's name, a membership test, a match on it.
BY_NAME = re.compile(
    r"\bsource\s*(==|!=)|\bsource\s+(not\s+)?in\s*[(\[{]\s*[\"']"
    r"|(==|!=)\s*[\"']wal[\"']|[\"']wal[\"']\s*(==|!=)"
    r"|\bmatch\s+[\w.]*source\b"
)


def _offences(root: Path) -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            name = path.relative_to(root).as_posix()
            if name.startswith(ALLOWED):
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if BY_NAME.search(code):
                    found.append(f"{name}:{number}: {line.strip()}")
    return found


def test_no_source_is_told_apart_by_name_outside_its_package_and_the_registry() -> None:
    offences = _offences(ROOT)
    assert not offences, "ask outbox.sources instead:\n" + "\n".join(offences)


@pytest.mark.parametrize(
    "line",
    [
        'if settings.source == "wal":',
        "if self.settings.source != 'wal' or slot:",
        'wal_mode = "wal" == s.source',
        'if source in ("wal",):',
        "match settings.source:",
    ],
)
def test_the_grep_would_see_them(tmp_path: Path, line: str) -> None:
    (tmp_path / "outbox").mkdir()
    (tmp_path / "outbox" / "tool.py").write_text(f"{line}\n    pass\n")
    for package in PACKAGES[1:]:
        (tmp_path / package).mkdir()
    assert len(_offences(tmp_path)) == 1


def test_every_setting_value_has_an_entry() -> None:
    values = OutboxSettings.model_fields["source"].annotation.__args__  # type: ignore[union-attr]
    assert set(values) == set(SOURCES)
    assert source_of(OutboxSettings(source="wal")) is WAL
    assert source_of(OutboxSettings()) is TABLE


def test_what_each_tool_is_told() -> None:
    # lag/doctor/status report on a slot in WAL mode, or when one exists (left over).
    assert WAL.reports_slot(False) and TABLE.reports_slot(True) and not TABLE.reports_slot(False)
    # lanes need owners: always with the table; in WAL mode while rows wait in the table.
    assert TABLE.needs_table_relays(0) and WAL.needs_table_relays(3)
    assert not WAL.needs_table_relays(0)
    assert WAL.held_by_table_rows and not TABLE.held_by_table_rows


def test_the_deployed_source_is_the_live_relays_when_they_all_run_another() -> None:
    assert deployed(TABLE, ["wal", "wal"]) is WAL  # a table-mode shell beside WAL relays
    assert deployed(WAL, ["table"]) is TABLE
    assert deployed(TABLE, ["table", "wal"]) is TABLE  # a switch: both run, the shell's
    assert deployed(WAL, ["table", "wal"]) is WAL
    assert deployed(TABLE, []) is TABLE  # nothing runs: the shell's
    assert deployed(WAL, ["some-future-source"]) is WAL  # unknown to this build
