"""Application code that fails deep in a helper (for the dead-letter trace tests): the
handler calls ``invoice_total``, which calls ``_line_total``, which fails."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def invoice_total(order: dict[str, Any]) -> int:
    return sum(_line_total(line) for line in order["lines"])


def _line_total(line: dict[str, Any]) -> int:
    return line.total * line["qty"]  # type: ignore[attr-defined,no-any-return]  # FAILS HERE


FAILING_LINE = next(
    n
    for n, text in enumerate(Path(__file__).read_text(encoding="utf-8").splitlines(), 1)
    if text.rstrip().endswith("# FAILS HERE")
)
