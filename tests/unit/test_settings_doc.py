"""The settings tables are generated from OutboxSettings: every setting has a description,
and ``outbox config reference`` lists every one."""

from __future__ import annotations

from outbox.settings_doc import markdown_table, rows


def test_every_setting_is_documented() -> None:
    undocumented = [env for env, _, desc in rows() if not desc]
    assert undocumented == [], f"settings without description=: {undocumented}"


def test_the_config_reference_table_lists_every_setting() -> None:
    table = markdown_table().splitlines()
    assert table[0] == "| environment variable | default | meaning |"
    listed = [line.split("`")[1] for line in table[2:]]
    assert listed == [env for env, _, _ in rows()]
    assert "OUTBOX_RELAY__BATCH_SIZE" in listed
    # A "|" in a description would split its row into more cells than the header has.
    assert [line for line in table[2:] if line.count(" | ") != 2] == []
