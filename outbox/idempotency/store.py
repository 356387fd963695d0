"""The idempotency store's SQL, in one place. Nothing else builds idempotency statements.

Every time comparison uses the database's ``now()``, never the application's clock: all
replicas then agree on whether a lease or a record has expired, whatever their clock skew.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    Update,
    and_,
    bindparam,
    cast,
    delete,
    extract,
    func,
    literal,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.sql.dml import ReturningInsert

from outbox.tables import Tables

PENDING = "pending"
COMPLETE = "complete"
FAILED = "failed"


@dataclass(frozen=True)
class IdempotencyStore:
    tables: Tables

    @cached_property
    def _where_record(self) -> tuple[ColumnElement[bool], ColumnElement[bool]]:
        t = self.tables.idempotency
        return (t.c.scope == bindparam("p_scope"), t.c.key == bindparam("p_key"))

    @cached_property
    def _claim_values(self) -> dict[str, object]:
        # The columns a fresh claim sets; a takeover sets the same ones (and clears the rest).
        return {
            "payload_hash": bindparam("p_hash"),
            "status": PENDING,
            "created_at": func.now(),
            "expires_at": func.now() + bindparam("p_ttl", type_=Interval()),
            "locked_until": func.now() + bindparam("p_lease", type_=Interval()),
            "lock_token": bindparam("p_token"),
        }

    @cached_property
    def insert_claim(self) -> ReturningInsert[Any]:
        """Claim a new key atomically: a row comes back only if this request inserted it.

        ``ON CONFLICT DO NOTHING`` does not wait for row locks held by the request running
        the operation, so a concurrent duplicate learns "in progress" at once.
        """
        t = self.tables.idempotency
        return (
            insert(t)
            .values(scope=bindparam("p_scope"), key=bindparam("p_key"), **self._claim_values)
            .on_conflict_do_nothing(index_elements=[t.c.scope, t.c.key])
            .returning(t.c.lock_token)
        )

    @cached_property
    def read(self) -> Select[Any]:
        """An existing record, with its lease and expiry judged by the database clock."""
        t = self.tables.idempotency
        return select(
            t.c.payload_hash,
            t.c.status,
            t.c.response_status,
            t.c.response_headers,
            t.c.response_body,
            (t.c.expires_at <= func.now()).label("expired"),
            func.coalesce(t.c.locked_until > func.now(), False).label("lease_live"),
            cast(func.ceil(extract("epoch", t.c.locked_until - func.now())), Integer).label(
                "lease_left"
            ),
        ).where(*self._where_record)

    @cached_property
    def takeover(self) -> Update:
        """Re-claim an expired record, or a pending one whose owner's lease ran out.

        ``FOR UPDATE SKIP LOCKED`` is the liveness test: an owner that is still running holds
        the row lock in its operation transaction, so it is skipped (never run twice) even
        if it overran its lease; a crashed owner's lock died with its connection.
        """
        t = self.tables.idempotency
        takeable = (
            select(t.c.scope, t.c.key)
            .where(
                *self._where_record,
                or_(
                    t.c.expires_at <= func.now(),
                    and_(
                        t.c.status == PENDING,
                        t.c.locked_until <= func.now(),
                        t.c.payload_hash == bindparam("p_hash"),
                    ),
                ),
            )
            .with_for_update(skip_locked=True)
        )
        return (
            update(t)
            .where(tuple_(t.c.scope, t.c.key).in_(takeable))
            .values(
                response_status=None,
                response_headers=None,
                response_body=None,
                completed_at=None,
                **self._claim_values,
            )
            .returning(t.c.lock_token)
        )

    @cached_property
    def lock_owned(self) -> Select[Any]:
        """Row-lock the record for the operation transaction, if this claim still owns it."""
        t = self.tables.idempotency
        return (
            select(literal(1))
            .select_from(t)
            .where(
                *self._where_record, t.c.lock_token == bindparam("p_token"), t.c.status == PENDING
            )
            .with_for_update()
        )

    @cached_property
    def finish(self) -> Update:
        """Store the final response in the operation's transaction and drop the lease."""
        t = self.tables.idempotency
        return (
            update(t)
            .where(*self._where_record, t.c.lock_token == bindparam("p_token"))
            .values(
                status=bindparam("p_status"),
                response_status=bindparam("p_response_status"),
                response_headers=bindparam("p_response_headers"),
                response_body=bindparam("p_response_body"),
                completed_at=func.now(),
                locked_until=None,
                lock_token=None,
            )
        )

    @cached_property
    def release(self) -> Delete:
        """Forget a claim after a transient failure, so a retry with the key runs afresh."""
        t = self.tables.idempotency
        return delete(t).where(*self._where_record, t.c.lock_token == bindparam("p_token"))

    @cached_property
    def purge_batch(self) -> Delete:
        """Delete up to ``limit`` expired records, skipping any a live request holds."""
        t = self.tables.idempotency
        expired = (
            select(t.c.scope, t.c.key)
            .where(t.c.expires_at <= func.now())
            .limit(bindparam("p_limit"))
            .with_for_update(skip_locked=True)
        )
        return delete(t).where(tuple_(t.c.scope, t.c.key).in_(expired))

    # -- parameters (the statements' bind names stay private to this module) -------------
    @staticmethod
    def record_params(scope: str, key: str) -> dict[str, Any]:
        return {"p_scope": scope, "p_key": key}

    @staticmethod
    def claim_params(
        scope: str, key: str, payload_hash: str, ttl: timedelta, lease: timedelta, token: UUID
    ) -> dict[str, Any]:
        return {
            "p_scope": scope,
            "p_key": key,
            "p_hash": payload_hash,
            "p_ttl": ttl,
            "p_lease": lease,
            "p_token": token,
        }

    @staticmethod
    def owner_params(scope: str, key: str, token: UUID) -> dict[str, Any]:
        return {"p_scope": scope, "p_key": key, "p_token": token}

    @staticmethod
    def finish_params(
        owner: dict[str, Any], status: int, headers: Sequence[tuple[str, str]], body: bytes
    ) -> dict[str, Any]:
        return {
            **owner,
            "p_status": COMPLETE if status < 400 else FAILED,
            "p_response_status": status,
            "p_response_headers": [list(h) for h in headers],
            "p_response_body": body,
        }

    @staticmethod
    def purge_params(limit: int) -> dict[str, Any]:
        return {"p_limit": limit}
