"""The list pages' filters: read from the query string (or a POSTed form), turned into the
stores' filter objects, and written back into links and hidden fields, so an action on
"this group" or "everything shown" acts on exactly what the operator was looking at."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from outbox.ops.deadletters import STATES, DeadLetterFilter

# Query parameter -> DeadLetterFilter field. Times are ISO 8601 (a browser's
# datetime-local value has no zone: read as UTC, like every time the console shows).
DEAD_LETTER_FIELDS = {
    "consumer": "consumer",
    "topic": "topic",
    "type": "event_type",
    "error_class": "error_class",
    "after": "after",
    "before": "before",
    "group": "group",
    "state": "state",
}


class BadFilter(ValueError):
    """A filter value the console cannot read (shown to the operator, 400)."""


def _time(name: str, value: str) -> dt.datetime:
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        raise BadFilter(f"{name}: not a date and time ({value[:40]!r})") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


@dataclass(frozen=True)
class DeadLetterQuery:
    """The dead-letter filters as the operator typed them (strings, blanks dropped)."""

    values: dict[str, str]

    @classmethod
    def read(cls, params: Mapping[str, str]) -> DeadLetterQuery:
        return cls(
            {k: params[k].strip() for k in DEAD_LETTER_FIELDS if (params.get(k) or "").strip()}
        )

    def filter(self, keys: tuple[tuple[str, str], ...] | None = None) -> DeadLetterFilter:
        args: dict[str, object] = {}
        for param, value in self.values.items():
            field = DEAD_LETTER_FIELDS[param]
            if field == "state" and value not in STATES:
                raise BadFilter(f"state: one of {', '.join(STATES)}")
            args[field] = _time(param, value) if field in ("after", "before") else value
        return DeadLetterFilter(keys=keys, **args)  # type: ignore[arg-type]

    def without(self, *names: str) -> dict[str, str]:
        return {k: v for k, v in self.values.items() if k not in names}


def letter_key(consumer: str, event_id: str) -> str:
    """One dead letter as a form value (both parts may hold any character)."""
    return json.dumps([consumer, event_id])


def read_keys(values: list[str]) -> tuple[tuple[str, str], ...]:
    keys = []
    for raw in values:
        try:
            consumer, event_id = json.loads(raw)
        except (ValueError, TypeError):
            raise BadFilter("a selected dead letter could not be read") from None
        if not isinstance(consumer, str) or not isinstance(event_id, str):
            raise BadFilter("a selected dead letter could not be read")
        keys.append((consumer, event_id))
    return tuple(keys)


# Page numbers past this are refused: an offset computed from them must fit a bigint.
MAX_PAGE = 1_000_000


def check_params(items: Iterable[tuple[str, str]]) -> None:
    """Refuse what no filter can hold: a NUL character (PostgreSQL text cannot store one,
    so no stored value matches it) in any name or value."""
    for name, value in items:
        if "\x00" in name or "\x00" in value:
            shown = name.replace("\x00", "\\x00")[:40]
            raise BadFilter(f"{shown}: NUL characters are not allowed")


def page_number(raw: str | None) -> int:
    """A ``page`` parameter: a whole number from 1 to :data:`MAX_PAGE` (1 when absent)."""
    if raw is None or raw == "":
        return 1
    if (
        not (raw.isascii() and raw.isdigit())
        or len(raw) > len(str(MAX_PAGE))
        or not 1 <= int(raw) <= MAX_PAGE
    ):
        raise BadFilter(f"page: a whole number from 1 to {MAX_PAGE:,}")
    return int(raw)
