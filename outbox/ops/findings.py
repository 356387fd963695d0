"""What a check found (``outbox doctor``): a level, what is wrong, what to do."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Level = Literal["ok", "warn", "error"]


@dataclass(frozen=True)
class Finding:
    check: str
    level: Level
    what: str
    action: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
