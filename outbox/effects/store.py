"""The effect ledger's SQL, in one place. Nothing else builds effect statements.

Locking, in short (the why is in :mod:`outbox.effects.ledger`):

* a claim is one ``INSERT ... ON CONFLICT DO NOTHING`` — the primary key makes it atomic,
  and it never waits on a row lock, so 50 concurrent callers get one winner at once;
* every other decision reads the row ``FOR UPDATE SKIP LOCKED`` inside a short transaction:
  a row that cannot be locked is held by a live owner (its call is running) or by another
  caller deciding right now — either way the answer is "in progress", never a second call;
* the owner holds the row lock (``lock_owned``) from just before its call until the outcome
  is written, and the lock dies with its connection if the process dies.

Every time comparison uses the database's ``now()``, so replicas agree whatever their clocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from typing import Any
from uuid import UUID

from sqlalchemy import (
    ColumnElement,
    Delete,
    Integer,
    Interval,
    Select,
    Table,
    Text,
    Update,
    bindparam,
    cast,
    delete,
    extract,
    func,
    literal,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB, insert
from sqlalchemy.sql.dml import ReturningInsert
from sqlalchemy.sql.elements import Label

from outbox.tables import Tables

PENDING = "pending"
DONE = "done"
FAILED = "failed"
UNKNOWN = "unknown"


@dataclass(frozen=True)
class EffectStore:
    tables: Tables

    @property
    def _t(self) -> Table:
        return self.tables.effects

    @cached_property
    def _where_key(self) -> ColumnElement[bool]:
        return self._t.c.key == bindparam("p_key")

    @cached_property
    def _lease_live(self) -> Label[bool]:
        """Whether the claim's lease still runs (a live owner)."""
        return func.coalesce(self._t.c.lease_until > func.now(), False).label("lease_live")

    @cached_property
    def _claim_values(self) -> dict[str, Any]:
        # What a fresh claim sets; a takeover sets the same (and clears any old outcome).
        return {
            "payload_hash": bindparam("p_hash"),
            "state": PENDING,
            "dependency": bindparam("p_dependency"),
            "dedupe_window": bindparam("p_window", type_=Interval()),
            "updated_at": func.now(),
            "lease_until": func.now() + bindparam("p_lease", type_=Interval()),
            "lock_token": bindparam("p_token"),
        }

    @cached_property
    def insert_claim(self) -> ReturningInsert[Any]:
        """Claim a new key: a row comes back only to the one caller that inserted it."""
        t = self._t
        return (
            insert(t)
            .values(key=bindparam("p_key"), **self._claim_values)
            .on_conflict_do_nothing(index_elements=[t.c.key])
            .returning(t.c.lock_token)
        )

    def _record(self) -> Select[Any]:
        t = self._t
        return select(
            t.c.key,
            t.c.payload_hash,
            t.c.state,
            t.c.result,
            t.c.error,
            func.coalesce(t.c.expires_at <= func.now(), False).label("expired"),
            self._lease_live,
            cast(
                func.greatest(func.ceil(extract("epoch", t.c.lease_until - func.now())), 1),
                Integer,
            ).label("lease_left"),
        ).where(self._where_key)

    @cached_property
    def read_unlocked_only(self) -> Select[Any]:
        """The record if no one else holds it (nothing comes back for a held row)."""
        return self._record().with_for_update(skip_locked=True)

    @cached_property
    def exists(self) -> Select[Any]:
        return select(literal(1)).select_from(self._t).where(self._where_key)

    @cached_property
    def takeover(self) -> Update:
        """Re-claim a row the caller holds locked: expired, or pending/unknown to reconcile."""
        return (
            update(self._t)
            .where(self._where_key)
            .values(
                result=None,
                error=None,
                completed_at=None,
                expires_at=None,
                **self._claim_values,
            )
        )

    @cached_property
    def lock_owned(self) -> Select[Any]:
        """Row-lock the record for the call, if this claim still owns it."""
        t = self._t
        return (
            select(literal(1))
            .select_from(t)
            .where(self._where_key, t.c.lock_token == bindparam("p_token"), t.c.state == PENDING)
            .with_for_update()
        )

    @cached_property
    def attempt_failed(self) -> Update:
        """Count an attempt that failed (the row is locked by its owner)."""
        t = self._t
        return (
            update(t)
            .where(self._where_key)
            .values(
                attempts=t.c.attempts + 1, last_error=bindparam("p_error"), updated_at=func.now()
            )
        )

    def _finish(self, state: str, **values: Any) -> Update:
        t = self._t
        return (
            update(t)
            .where(self._where_key)
            .values(
                state=state,
                attempts=t.c.attempts + bindparam("p_called", type_=Integer),
                updated_at=func.now(),
                completed_at=func.now(),
                expires_at=func.now() + t.c.dedupe_window,
                lease_until=None,
                lock_token=None,
                **values,
            )
        )

    @cached_property
    def finish_done(self) -> Update:
        return self._finish(DONE, result=bindparam("p_result", type_=JSONB()))

    @cached_property
    def finish_failed(self) -> Update:
        return self._finish(FAILED, error=bindparam("p_result", type_=JSONB()))

    @cached_property
    def mark_unknown(self) -> Update:
        """Park the key: nobody calls it until it is reconciled or resolved."""
        return (
            update(self._t)
            .where(self._where_key)
            .values(
                state=UNKNOWN,
                last_error=bindparam("p_error"),
                updated_at=func.now(),
                lease_until=None,
                lock_token=None,
            )
        )

    @cached_property
    def release(self) -> Delete:
        """Forget a claim whose effect provably did not happen, so the key can run again."""
        return delete(self._t).where(self._where_key)

    # -- operators ------------------------------------------------------------------------
    @cached_property
    def get(self) -> Select[Any]:
        t = self._t
        return select(
            t,
            self._lease_live,
        ).where(self._where_key)

    @cached_property
    def list(self) -> Select[Any]:
        t = self._t
        state = bindparam("p_state", type_=Text())
        return (
            select(t, self._lease_live)
            .where((state.is_(None)) | (t.c.state == state))
            .order_by(t.c.updated_at.desc(), t.c.key)
            .limit(bindparam("p_limit"))
        )

    # -- parameters (the bind names stay private to this module) -----------------------------
    @staticmethod
    def key_params(key: str) -> dict[str, Any]:
        return {"p_key": key}

    @staticmethod
    def claim_params(
        key: str,
        payload_hash: str,
        dependency: str,
        window: timedelta,
        lease: timedelta,
        token: UUID,
    ) -> dict[str, Any]:
        return {
            "p_key": key,
            "p_hash": payload_hash,
            "p_dependency": dependency,
            "p_window": window,
            "p_lease": lease,
            "p_token": token,
        }

    @staticmethod
    def owner_params(key: str, token: UUID) -> dict[str, Any]:
        return {"p_key": key, "p_token": token}

    @staticmethod
    def outcome_params(key: str, value: Any, called: bool) -> dict[str, Any]:
        return {"p_key": key, "p_result": value, "p_called": int(called)}

    @staticmethod
    def error_params(key: str, error: str) -> dict[str, Any]:
        return {"p_key": key, "p_error": error}

    @staticmethod
    def list_params(state: str | None, limit: int) -> dict[str, Any]:
        return {"p_state": state, "p_limit": limit}
