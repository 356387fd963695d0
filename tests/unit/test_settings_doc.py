"""The README's configuration table is generated from OutboxSettings and must match it."""

from __future__ import annotations

from pathlib import Path

from outbox.settings_doc import markdown_table, rows, with_table

README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_setting_is_documented() -> None:
    undocumented = [env for env, _, desc in rows() if not desc]
    assert undocumented == [], f"settings without description=: {undocumented}"


def test_readme_table_is_current() -> None:
    text = README.read_text()
    assert with_table(text) == text, (
        "README configuration table is stale: run `python -m outbox.settings_doc README.md`"
    )
    assert "`OUTBOX_RELAY__BATCH_SIZE`" in markdown_table()
