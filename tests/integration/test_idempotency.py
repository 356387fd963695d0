"""Idempotent requests on real PostgreSQL: the seeds' outcome tables, reproduced.

| request                         | expected                                     |
|---------------------------------|----------------------------------------------|
| k1 + payload A                  | created (operation ran, response stored)     |
| k1 + payload A again            | replayed: same status, body bytes, headers   |
| k1 + payload B                  | conflict (idempotency.payload_mismatch)      |
| 50 x k1 concurrently            | runs once; others replayed or in progress    |
| owner SIGKILLed mid-operation   | after the lease, a retry runs it; effect x1  |
| transient failure               | key released; retry runs once more; effect x1|
| final failure                   | stored and replayed; operation not re-run    |
| expired key                     | treated as new                               |
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from outbox import Outbox
from outbox.db import async_engine
from outbox.idempotency import (
    IdempotencyConflict,
    IdempotencyInProgress,
    IdempotencyKeys,
    IdempotencyLockLost,
    InvalidIdempotencyKey,
    StoredResponse,
    request_hash,
    scope_for,
    strip_fields,
)
from outbox.idempotency.metrics import OUTCOMES
from outbox.resilience.classify import HttpStatusError, Permanent
from outbox.settings import OutboxSettings
from tests.support.idempotency import (
    create_effects_table,
    effect_count,
    outbox_count,
    record_of,
    write_effect,
    write_effect_async,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
A = {"amount": 100, "charge": "ch_1"}
B = {"amount": 999, "charge": "ch_1"}


@pytest.fixture(scope="module")
def keys(settings: OutboxSettings, engine: Engine) -> IdempotencyKeys:
    create_effects_table(engine)
    return IdempotencyKeys(settings)


@pytest.fixture(scope="module")
def outbox(settings: OutboxSettings) -> Outbox:
    return Outbox(settings)


@pytest.fixture
def scope() -> str:
    return scope_for(f"tenant-{uuid.uuid4().hex[:8]}", "POST /effects")


def _run(
    keys: IdempotencyKeys,
    engine: Engine,
    outbox: Outbox,
    scope: str,
    key: str,
    body: dict[str, Any],
    **kwargs: Any,
) -> Any:
    return keys.run(
        engine,
        scope=scope,
        key=key,
        payload=body,
        operation=lambda s: write_effect(s, outbox, scope, key, body),
        **kwargs,
    )


# ------------------------------------------------------------------- outcome table


def test_created_then_replayed_then_conflict(
    keys: IdempotencyKeys, engine: Engine, outbox: Outbox, scope: str
) -> None:
    first = _run(keys, engine, outbox, scope, "k1", A)
    assert (first.replayed, first.stored, first.response.status) == (False, True, 201)
    assert effect_count(engine, scope) == 1
    assert outbox_count(engine, outbox, scope, "k1") == 1
    record = record_of(engine, outbox, scope, "k1")
    assert record is not None
    assert record["status"] == "complete" and record["lock_token"] is None
    assert record["response_body"] == first.response.body

    again = _run(keys, engine, outbox, scope, "k1", A)
    assert again.replayed is True
    assert again.response == first.response  # status, body bytes and headers
    assert effect_count(engine, scope) == 1
    assert outbox_count(engine, outbox, scope, "k1") == 1

    with pytest.raises(IdempotencyConflict) as info:
        _run(keys, engine, outbox, scope, "k1", B)
    assert info.value.code == "idempotency.payload_mismatch"
    assert info.value.http_status == 422
    assert effect_count(engine, scope) == 1


async def test_async_created_then_replayed_then_conflict(
    keys: IdempotencyKeys, engine: Engine, aengine: AsyncEngine, outbox: Outbox, scope: str
) -> None:
    async def run(body: dict[str, Any]) -> Any:
        return await keys.run_async(
            aengine,
            scope=scope,
            key="k1",
            payload=body,
            operation=lambda s: write_effect_async(s, outbox, scope, "k1", body),
        )

    first = await run(A)
    again = await run(A)
    assert (first.replayed, again.replayed) == (False, True)
    assert again.response == first.response
    with pytest.raises(IdempotencyConflict):
        await run(B)
    assert effect_count(engine, scope) == 1
    assert outbox_count(engine, outbox, scope, "k1") == 1


def test_keys_are_scoped_per_principal_and_route(
    keys: IdempotencyKeys, engine: Engine, outbox: Outbox
) -> None:
    tenant = uuid.uuid4().hex
    scopes = [
        scope_for(f"{tenant}-a", "POST /effects"),
        scope_for(f"{tenant}-b", "POST /effects"),
        scope_for(f"{tenant}-a", "POST /other"),
    ]
    outcomes = [_run(keys, engine, outbox, s, "same-key", A) for s in scopes]
    assert [o.replayed for o in outcomes] == [False, False, False]
    assert [effect_count(engine, s) for s in scopes] == [1, 1, 1]
    # The encoding is unambiguous: a separator inside a principal cannot forge a scope.
    assert scope_for("a|b", "c") != scope_for("a", "b|c")


async def test_fifty_concurrent_requests_run_the_operation_once(
    keys: IdempotencyKeys, settings: OutboxSettings, engine: Engine, outbox: Outbox, scope: str
) -> None:
    calls = 0

    async def operation(session: AsyncSession) -> StoredResponse:
        nonlocal calls
        calls += 1
        response = await write_effect_async(session, outbox, scope, "k1", A)
        await asyncio.sleep(0.3)  # keep it in flight while the others arrive
        return response

    big = async_engine(settings, pool_size=25, max_overflow=30)
    start = asyncio.Event()

    async def request() -> Any:
        await start.wait()
        try:
            return await keys.run_async(big, scope=scope, key="k1", payload=A, operation=operation)
        except IdempotencyInProgress as exc:
            return exc

    try:
        tasks = [asyncio.create_task(request()) for _ in range(50)]
        await asyncio.sleep(0.05)
        start.set()
        results = await asyncio.gather(*tasks)
    finally:
        await big.dispose()

    created = [r for r in results if not isinstance(r, Exception) and not r.replayed]
    replayed = [r for r in results if not isinstance(r, Exception) and r.replayed]
    in_progress = [r for r in results if isinstance(r, IdempotencyInProgress)]
    assert calls == 1
    assert len(created) == 1
    assert len(created) + len(replayed) + len(in_progress) == 50
    assert in_progress, "with a 0.3 s operation some requests must see it in flight"
    assert all(r.response == created[0].response for r in replayed)
    assert all(e.retry_after >= 1 for e in in_progress)
    assert effect_count(engine, scope) == 1
    assert outbox_count(engine, outbox, scope, "k1") == 1


# ------------------------------------------------------------------ in flight, crash


def _in_background(fn: Any) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []

    def target() -> None:
        try:
            result.append(fn())
        except Exception as exc:
            result.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, result


def test_in_flight_request_answers_in_progress_without_waiting(
    keys: IdempotencyKeys, engine: Engine, outbox: Outbox, scope: str
) -> None:
    inside, release = threading.Event(), threading.Event()

    def slow(session: Session) -> StoredResponse:
        response = write_effect(session, outbox, scope, "k1", A)
        inside.set()
        release.wait(10)
        return response

    thread, result = _in_background(
        lambda: keys.run(engine, scope=scope, key="k1", payload=A, operation=slow)
    )
    assert inside.wait(10)
    began = time.monotonic()
    with pytest.raises(IdempotencyInProgress) as info:
        _run(keys, engine, outbox, scope, "k1", A)
    assert time.monotonic() - began < 1.0, "a duplicate must not block on the owner's lock"
    assert info.value.http_status == 409 and info.value.code == "idempotency.in_progress"
    # The owner's effects are not visible before its commit.
    assert effect_count(engine, scope) == 0
    release.set()
    thread.join(10)
    assert not result[0].replayed
    assert _run(keys, engine, outbox, scope, "k1", A).replayed
    assert effect_count(engine, scope) == 1


def test_live_owner_past_its_lease_is_not_taken_over(
    keys: IdempotencyKeys, engine: Engine, outbox: Outbox, scope: str
) -> None:
    inside, release = threading.Event(), threading.Event()
    lease = timedelta(seconds=0.5)

    def slow(session: Session) -> StoredResponse:
        response = write_effect(session, outbox, scope, "k1", A)
        inside.set()
        release.wait(10)
        return response

    thread, result = _in_background(
        lambda: keys.run(
            engine, scope=scope, key="k1", payload=A, operation=slow, lock_timeout=lease
        )
    )
    assert inside.wait(10)
    time.sleep(1.0)  # the lease has run out, but the owner still holds the row lock
    with pytest.raises(IdempotencyInProgress):
        _run(keys, engine, outbox, scope, "k1", A, lock_timeout=lease)
    release.set()
    thread.join(10)
    assert not isinstance(result[0], Exception) and not result[0].replayed
    assert effect_count(engine, scope) == 1


def test_owner_killed_mid_operation_is_taken_over_after_its_lease(
    keys: IdempotencyKeys, settings: OutboxSettings, engine: Engine, outbox: Outbox, scope: str
) -> None:
    lease_seconds = 2.0
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.idempotency_crasher",
            settings.database_url.get_secret_value(),
            scope,
            "k1",
            str(lease_seconds),
            json.dumps(A),
        ],
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env=env,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "IN_OPERATION"
        with pytest.raises(IdempotencyInProgress):
            _run(keys, engine, outbox, scope, "k1", A)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    record = record_of(engine, outbox, scope, "k1")
    assert record is not None and record["status"] == "pending"
    assert effect_count(engine, scope) == 0, "the killed owner's effects rolled back"

    deadline = time.monotonic() + lease_seconds + 10
    outcome = None
    refusals = 0
    while outcome is None:
        try:
            outcome = _run(keys, engine, outbox, scope, "k1", A)
        except IdempotencyInProgress as exc:
            refusals += 1
            assert time.monotonic() < deadline, "the dead owner's claim was never taken over"
            time.sleep(min(exc.retry_after, 0.2))
    assert not outcome.replayed and outcome.response.status == 201
    assert effect_count(engine, scope) == 1
    assert outbox_count(engine, outbox, scope, "k1") == 1
    assert _run(keys, engine, outbox, scope, "k1", A).replayed


def test_owner_whose_claim_was_taken_over_before_it_began_does_not_run(
    keys: IdempotencyKeys, engine: Engine, outbox: Outbox, scope: str
) -> None:
    lease = timedelta(seconds=0.3)
    calls: list[str] = []

    def paused_session() -> Session:
        # The owner stalls between claim and operation (GC pause, slow pool) past its
        # lease; meanwhile a retry takes the key over and completes it.
        time.sleep(0.5)
        calls.append("retry")
        assert not _run(keys, engine, outbox, scope, "k1", A, lock_timeout=lease).replayed
        return Session(engine)

    def operation(session: Session) -> StoredResponse:
        calls.append("stalled owner")
        return write_effect(session, outbox, scope, "k1", A)

    with pytest.raises(IdempotencyLockLost):
        keys.run(
            engine,
            scope=scope,
            key="k1",
            payload=A,
            operation=operation,
            lock_timeout=lease,
            session_factory=paused_session,
        )
    assert calls == ["retry"]
    assert effect_count(engine, scope) == 1
    assert _run(keys, engine, outbox, scope, "k1", A).replayed


# ----------------------------------------------------------------- failures


def test_transient_failure_releases_the_key_and_a_retry_runs_once_more(
    keys: IdempotencyKeys, engine: Engine, outbox: Outbox, scope: str
) -> None:
    calls = 0

    def flaky(session: Session) -> StoredResponse:
        nonlocal calls
        calls += 1
        response = write_effect(session, outbox, scope, "k1", A)
        if calls == 1:
            raise ConnectionResetError("payment provider reset the connection")
        return response

    def run() -> Any:
        return keys.run(engine, scope=scope, key="k1", payload=A, operation=flaky)

    with pytest.raises(ConnectionResetError):
        run()
    assert record_of(engine, outbox, scope, "k1") is None, "transient failure releases the key"
    assert effect_count(engine, scope) == 0
    assert outbox_count(engine, outbox, scope, "k1") == 0

    second = run()
    third = run()
    assert calls == 2
    assert (second.replayed, third.replayed) == (False, True)
    assert effect_count(engine, scope) == 1
    assert outbox_count(engine, outbox, scope, "k1") == 1


def test_returned_retryable_status_rolls_back_and_is_not_stored(
    keys: IdempotencyKeys, engine: Engine, outbox: Outbox, scope: str
) -> None:
    def unavailable(session: Session) -> StoredResponse:
        write_effect(session, outbox, scope, "k1", A)
        return StoredResponse.json(503, {"error": "try again"})

    outcome = keys.run(engine, scope=scope, key="k1", payload=A, operation=unavailable)
    assert (outcome.response.status, outcome.stored) == (503, False)
    assert record_of(engine, outbox, scope, "k1") is None
    assert effect_count(engine, scope) == 0
    assert _run(keys, engine, outbox, scope, "k1", A).replayed is False
    assert effect_count(engine, scope) == 1


def test_final_failure_is_stored_and_replayed(
    keys: IdempotencyKeys, engine: Engine, outbox: Outbox, scope: str
) -> None:
    calls = 0

    class InsufficientBalance(Permanent):
        status_code = 402
        code = "refund.insufficient_balance"

    def declined(session: Session) -> StoredResponse:
        nonlocal calls
        calls += 1
        write_effect(session, outbox, scope, "k1", A)
        raise InsufficientBalance("charge ch_1 has no balance left to refund")

    def run() -> Any:
        return keys.run(engine, scope=scope, key="k1", payload=A, operation=declined)

    with pytest.raises(InsufficientBalance):
        run()
    record = record_of(engine, outbox, scope, "k1")
    assert record is not None and record["status"] == "failed"
    replay = run()
    assert calls == 1
    assert replay.replayed and replay.response.status == 402
    assert b"refund.insufficient_balance" in replay.response.body
    assert effect_count(engine, scope) == 0, "a failed operation's effects roll back"
    assert outbox_count(engine, outbox, scope, "k1") == 0


def test_returned_client_error_is_stored_as_failed_and_replayed(
    keys: IdempotencyKeys, engine: Engine, outbox: Outbox, scope: str
) -> None:
    calls = 0

    def rejected(session: Session) -> StoredResponse:
        nonlocal calls
        calls += 1
        return StoredResponse.json(422, {"error": {"code": "refund.amount_too_large"}})

    first = keys.run(engine, scope=scope, key="k1", payload=A, operation=rejected)
    second = keys.run(engine, scope=scope, key="k1", payload=A, operation=rejected)
    assert calls == 1
    assert (first.replayed, second.replayed) == (False, True)
    assert second.response == first.response
    record = record_of(engine, outbox, scope, "k1")
    assert record is not None and record["status"] == "failed"


def test_http_status_errors_classify_as_final_or_transient(
    keys: IdempotencyKeys, engine: Engine, scope: str
) -> None:
    def fail_with(status: int) -> Any:
        def op(session: Session) -> StoredResponse:
            raise HttpStatusError(status)

        return op

    with pytest.raises(HttpStatusError):
        keys.run(engine, scope=scope, key="k404", payload=A, operation=fail_with(404))
    with pytest.raises(HttpStatusError):
        keys.run(engine, scope=scope, key="k502", payload=A, operation=fail_with(502))
    t = keys.tables.idempotency
    with engine.connect() as conn:
        rows = dict(
            conn.execute(
                t.select().with_only_columns(t.c.key, t.c.status).where(t.c.scope == scope)
            ).all()
        )
    assert rows == {"k404": "failed"}


# ----------------------------------------------------------------- expiry, purge, keys


def test_expired_key_is_treated_as_new(
    keys: IdempotencyKeys, engine: Engine, outbox: Outbox, scope: str
) -> None:
    short = timedelta(seconds=0.5)
    first = _run(keys, engine, outbox, scope, "k1", A, ttl=short)
    time.sleep(0.7)
    second = keys.run(
        engine,
        scope=scope,
        key="k1",
        payload=B,  # even another payload: the old record is forgotten
        operation=lambda s: StoredResponse.json(201, {"second": True}),
    )
    assert (first.replayed, second.replayed) == (False, False)
    assert second.response.body == b'{"second":true}'
    record = record_of(engine, outbox, scope, "k1")
    assert record is not None and record["payload_hash"] == request_hash(B)


def test_purge_deletes_expired_records_in_bounded_batches(
    keys: IdempotencyKeys, engine: Engine, outbox: Outbox, scope: str
) -> None:
    def ok(session: Session) -> StoredResponse:
        return StoredResponse(204)

    # Other tests' expired leftovers would blur the counts: start from none.
    keys.purge_expired(engine)
    for i in range(25):
        keys.run(
            engine,
            scope=scope,
            key=f"old-{i}",
            payload=A,
            operation=ok,
            ttl=timedelta(microseconds=1),
        )
    for i in range(3):
        keys.run(engine, scope=scope, key=f"live-{i}", payload=A, operation=ok)

    assert keys.purge_expired(engine, batch_size=10, max_batches=1) == 10
    assert keys.purge_expired(engine, batch_size=10) == 15
    t = keys.tables.idempotency
    with engine.connect() as conn:
        left = (
            conn.execute(t.select().with_only_columns(t.c.key).where(t.c.scope == scope))
            .scalars()
            .all()
        )
    assert sorted(left) == ["live-0", "live-1", "live-2"]


async def test_async_purge(keys: IdempotencyKeys, aengine: AsyncEngine, scope: str) -> None:
    async def ok(session: AsyncSession) -> StoredResponse:
        return StoredResponse(204)

    await keys.purge_expired_async(aengine)
    for i in range(3):
        await keys.run_async(
            aengine,
            scope=scope,
            key=f"old-{i}",
            payload=A,
            operation=ok,
            ttl=timedelta(microseconds=1),
        )
    assert await keys.purge_expired_async(aengine, batch_size=2) == 3


@pytest.mark.parametrize("bad", ["", "x" * 256, "tab\there"])
def test_invalid_keys_are_rejected_before_any_write(
    keys: IdempotencyKeys, engine: Engine, scope: str, bad: str
) -> None:
    with pytest.raises(InvalidIdempotencyKey):
        keys.run(engine, scope=scope, key=bad, payload=A, operation=lambda s: StoredResponse(200))


def test_key_of_255_characters_is_accepted_and_the_table_enforces_the_bound(
    keys: IdempotencyKeys, engine: Engine, outbox: Outbox, scope: str
) -> None:
    assert not _run(keys, engine, outbox, scope, "k" * 255, A).replayed
    t = keys.tables.idempotency
    with pytest.raises(IntegrityError), engine.begin() as conn:
        conn.execute(
            t.insert().values(
                scope=scope,
                key="k" * 256,
                payload_hash="x",
                status="pending",
                expires_at=text("now()"),
            )
        )


def test_volatile_fields_can_be_stripped_before_hashing() -> None:
    sent = {"amount": 10, "meta": {"sent_at": "12:00:01", "reason": "dup"}, "trace": "a"}
    retry = {"amount": 10.0, "meta": {"sent_at": "12:00:07", "reason": "dup"}, "trace": "b"}
    ignore = ["meta.sent_at", "trace"]
    assert request_hash(sent) != request_hash(retry)
    assert request_hash(sent, ignore) == request_hash(retry, ignore)
    assert request_hash({**strip_fields(sent, ignore), "amount": 11}) != request_hash(sent, ignore)
    assert strip_fields([1, 2], ignore) == [1, 2]


# ------------------------------------------------------------------------- metrics


def test_each_request_is_counted_once_by_outcome(
    settings: OutboxSettings, engine: Engine, outbox: Outbox, scope: str
) -> None:
    registry = CollectorRegistry()
    keys = IdempotencyKeys(settings, registry=registry)

    def counts() -> dict[str, float]:
        return {
            s.labels["outcome"]: s.value
            for m in registry.collect()
            for s in m.samples
            if s.name == "outbox_idempotency_requests_total"
        }

    assert set(counts()) == set(OUTCOMES) and not any(counts().values()), "all at 0 from start"
    _run(keys, engine, outbox, scope, "k1", A)
    _run(keys, engine, outbox, scope, "k1", A)
    with pytest.raises(IdempotencyConflict):
        _run(keys, engine, outbox, scope, "k1", B)

    def reject(session: Session) -> StoredResponse:
        raise Permanent("card declined")

    def reset(session: Session) -> StoredResponse:
        raise ConnectionResetError("provider reset the connection")

    for key, operation, error in (("k2", reject, Permanent), ("k3", reset, ConnectionResetError)):
        with pytest.raises(error):
            keys.run(engine, scope=scope, key=key, payload=A, operation=operation)
    assert {k: v for k, v in counts().items() if v} == {
        "created": 1,
        "replayed": 1,
        "conflict": 1,
        "failed": 1,
        "released": 1,
    }
