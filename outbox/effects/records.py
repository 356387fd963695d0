"""The side-effect ledger as operators see it: its records, and the verdicts an operator
gives an effect whose outcome is unknown (the console and `outbox effects`)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine

from outbox.db import translated_errors
from outbox.effects.errors import (
    EffectInProgress,
    EffectNotFound,
    EffectNotResolvable,
    EffectResultInvalid,
)
from outbox.effects.store import PENDING, UNKNOWN, EffectStore

log = logging.getLogger("outbox.effects")
MESSAGE_LIMIT = 500  # characters of an error message kept


@dataclass(frozen=True)
class EffectRecord:
    """One ledger record, as operators see it."""

    key: str
    state: str
    dependency: str
    payload_hash: str
    result: Any
    error: dict[str, Any] | None
    attempts: int
    last_error: str | None
    dedupe_window: timedelta
    created_at: datetime
    updated_at: datetime
    completed_at: datetime | None
    expires_at: datetime | None
    lease_until: datetime | None
    lease_live: bool

    @classmethod
    def from_row(cls, row: Any) -> EffectRecord:
        return cls(**{f: getattr(row, f) for f in cls.__dataclass_fields__})

    def to_dict(self) -> dict[str, Any]:
        data = {f: getattr(self, f) for f in self.__dataclass_fields__}
        for name, value in data.items():
            if isinstance(value, datetime):
                data[name] = value.isoformat()
        data["dedupe_window"] = self.dedupe_window.total_seconds()
        return data


def jsonable(key: str, value: Any) -> tuple[Any, EffectResultInvalid | None]:
    """``value`` as it will read back from JSONB (tuples become lists...), so the first
    caller and every replay see equal results."""
    try:
        return json.loads(json.dumps(value, allow_nan=False)), None
    except (TypeError, ValueError):
        return None, EffectResultInvalid(key, type(value).__name__)


class EffectOperations:
    """What an operator may do to the ledger (a part of :class:`~outbox.effects.Effects`)."""

    _store: EffectStore

    # -- operators -------------------------------------------------------------------------
    def records(
        self, engine: Engine, state: str | None = None, limit: int = 100
    ) -> list[EffectRecord]:
        """Records, most recently changed first; ``state`` filters (pending, done, ...)."""
        with translated_errors(), engine.connect() as conn:
            rows = conn.execute(self._store.list, self._store.list_params(state, limit))
            return [EffectRecord.from_row(r) for r in rows]

    def get(self, engine: Engine, key: str) -> EffectRecord:
        with translated_errors(), engine.connect() as conn:
            row = conn.execute(self._store.get, self._store.key_params(key)).first()
        if row is None:
            raise EffectNotFound(key)
        return EffectRecord.from_row(row)

    def resolve(self, engine: Engine, key: str, *, applied: bool, result: Any = None) -> None:
        """An operator's verdict on an ``unknown`` effect (or a ``pending`` one whose caller
        died): ``applied=True`` stores ``result`` as done (replayed from now on);
        ``applied=False`` forgets the claim, so the next caller with the key calls again."""
        store = self._store
        stored, invalid = jsonable(key, result)
        if invalid is not None:
            raise invalid
        with translated_errors(), engine.begin() as conn:
            self._resolvable(conn, key)
            if applied:
                conn.execute(store.finish_done, store.outcome_params(key, stored, False))
            else:
                conn.execute(store.release, store.key_params(key))
        log.warning(
            "effect %s resolved by an operator as %s", key, "applied" if applied else "not applied"
        )

    def give_up(self, engine: Engine, key: str, reason: str = "given up by an operator") -> None:
        """Settle an ``unknown`` effect (or a ``pending`` one whose caller died) as failed
        for good: callers with this key get the stored failure replayed and never call the
        dependency again (until the record expires)."""
        store = self._store
        error = {"type": "GivenUp", "message": reason[:MESSAGE_LIMIT], "status": None}
        with translated_errors(), engine.begin() as conn:
            self._resolvable(conn, key)
            conn.execute(store.finish_failed, store.outcome_params(key, error, False))
        log.warning("effect %s given up by an operator", key)

    def _resolvable(self, conn: Any, key: str) -> None:
        """Lock ``key``'s record for an operator's verdict, or raise why it cannot have one."""
        store = self._store
        row = conn.execute(store.read_unlocked_only, store.key_params(key)).first()
        if row is None:
            if conn.execute(store.exists, store.key_params(key)).first() is None:
                raise EffectNotFound(key)
            raise EffectInProgress(key)  # its caller holds it right now
        if not (row.state == UNKNOWN or (row.state == PENDING and not row.lease_live)):
            raise EffectNotResolvable(key, row.state)
