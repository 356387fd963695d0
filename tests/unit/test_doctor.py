"""Pure parts of `outbox doctor`: exit codes and the advice it prints."""

from __future__ import annotations

import pytest

from outbox.ops.doctor import _create_index_sql, exit_code
from outbox.ops.findings import Finding
from outbox.settings import OutboxSettings
from outbox.tables import build_tables


def f(level: str) -> Finding:
    return Finding("x", level, "what")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("levels", "strict", "code"),
    [
        (["ok"], False, 0),
        (["ok", "warn"], False, 0),
        (["ok", "warn"], True, 2),
        (["warn", "error"], False, 1),
        (["warn", "error"], True, 1),
        ([], True, 0),
    ],
)
def test_exit_code(levels: list[str], strict: bool, code: int) -> None:
    assert exit_code([f(level) for level in levels], strict) == code


def test_claim_index_advice_is_concurrent_and_schema_qualified() -> None:
    tables = build_tables(OutboxSettings(db_schema="shop", table_prefix="ob_"))
    [claim] = [i for i in tables.events.indexes if str(i.name).endswith("claim_idx")]
    sql = _create_index_sql(claim)
    assert sql.startswith("CREATE INDEX CONCURRENTLY ob_events_claim_idx ON shop.ob_events")
    assert "WHERE published_at IS NULL" in sql
    assert sql.endswith(";")
