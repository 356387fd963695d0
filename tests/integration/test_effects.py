"""The effect ledger against real PostgreSQL and the fake payment provider on real HTTP
(loopback): each external effect happens once, ambiguous outcomes are reconciled, never
blindly retried. Effects are counted by the provider."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine, event, func, select, text, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.agent_tools.client import ProviderClient
from examples.agent_tools.provider import FakeProvider
from outbox.db import async_engine, sync_engine
from outbox.effects import (
    NOT_APPLIED,
    EffectConflict,
    EffectFailed,
    EffectInProgress,
    EffectLeaseLost,
    EffectOutcomeUnknown,
    EffectResultInvalid,
    Effects,
)
from outbox.errors import OutboxError
from outbox.ops.cleanup import Retention, run_cleanup
from outbox.resilience import (
    CircuitBreaker,
    CircuitOpen,
    RetryBudget,
    RetryBudgetExhausted,
    RetryPolicy,
)
from outbox.settings import OutboxSettings
from outbox.tables import build_tables
from tests.support.effects_crasher import AMOUNT, CHARGE

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
ARGS = {"charge": "ch_1", "amount": 1400}


@pytest.fixture(scope="module")
def provider() -> Iterator[FakeProvider]:
    with FakeProvider(slow_seconds=1.5) as p:
        yield p


@pytest.fixture
def client(provider: FakeProvider) -> ProviderClient:
    provider.clear_faults()
    return ProviderClient(provider.url, timeout=0.5)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def effects(settings: OutboxSettings, registry: CollectorRegistry) -> Effects:
    return Effects(
        settings,
        policy=RetryPolicy(base_seconds=0.05, cap_seconds=0.2, max_attempts=4),
        registry=registry,
    )


def new_key() -> str:
    return f"test-{uuid.uuid4()}"


def metric(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def record(engine: Engine, settings: OutboxSettings, key: str) -> Any:
    t = build_tables(settings).effects
    with engine.connect() as conn:
        return conn.execute(select(t).where(t.c.key == key)).first()


def requests(provider: FakeProvider) -> int:
    """Refund requests (POST /refunds) the provider received so far."""
    return int(ProviderClient(provider.url).stats()["requests"])


def refund_via(client: ProviderClient) -> Callable[[str], Any]:
    return lambda key: client.refund(ARGS["charge"], ARGS["amount"], idempotency_key=key)


def reconcile_via(client: ProviderClient) -> Callable[[str], Any]:
    def reconcile(key: str) -> Any:
        found = client.find_refund(key)
        return NOT_APPLIED if found is None else found

    return reconcile


def test_apply_then_timeout_is_reconciled_into_one_effect(
    effects: Effects,
    engine: Engine,
    settings: OutboxSettings,
    provider: FakeProvider,
    client: ProviderClient,
    registry: CollectorRegistry,
) -> None:
    key, before = new_key(), provider.effects
    provider.fail_next("apply_then_timeout")
    result = effects.run(
        engine,
        key=key,
        payload=ARGS,
        call=refund_via(client),
        reconcile=reconcile_via(client),
        dependency="psp",
    )
    assert result["idempotency_key"] == key
    assert provider.effects - before == 1
    row = record(engine, settings, key)
    assert row.state == "done" and row.result == result and row.attempts == 1
    assert metric(registry, "outbox_effects_reconciliations_total", result="applied") == 1
    assert metric(registry, "outbox_effects_calls_total", dependency="psp", outcome="ambiguous")
    # Every later caller gets the stored result, no call.
    sent = requests(provider)
    again = effects.run(engine, key=key, payload=ARGS, call=refund_via(client))
    assert again == result and requests(provider) == sent
    assert metric(registry, "outbox_effects_replays_total", state="done") == 1


async def test_async_apply_then_die_is_reconciled(
    effects: Effects, aengine: AsyncEngine, provider: FakeProvider, client: ProviderClient
) -> None:
    key, before = new_key(), provider.effects
    provider.fail_next("apply_then_die")

    async def call(k: str) -> Any:
        return await asyncio.to_thread(refund_via(client), k)

    async def reconcile(k: str) -> Any:
        return await asyncio.to_thread(reconcile_via(client), k)

    result = await effects.run_async(aengine, key=key, payload=ARGS, call=call, reconcile=reconcile)
    assert result["idempotency_key"] == key and provider.effects - before == 1
    again = await effects.run_async(aengine, key=key, payload=ARGS, call=call)
    assert again == result and provider.effects - before == 1


def test_ambiguous_without_reconcile_is_unknown_and_never_called_again(
    effects: Effects,
    engine: Engine,
    settings: OutboxSettings,
    provider: FakeProvider,
    client: ProviderClient,
    registry: CollectorRegistry,
) -> None:
    key, before = new_key(), provider.effects
    provider.fail_next("bad_gateway")  # applied, then 502
    with pytest.raises(EffectOutcomeUnknown):
        effects.run(engine, key=key, payload=ARGS, call=refund_via(client))
    sent = requests(provider)
    for _ in range(3):
        with pytest.raises(EffectOutcomeUnknown):
            effects.run(engine, key=key, payload=ARGS, call=refund_via(client))
    assert requests(provider) == sent, "no second call"
    assert provider.effects - before == 1
    row = record(engine, settings, key)
    assert row.state == "unknown" and "HTTPError" in row.last_error
    assert metric(registry, "outbox_effects_unknown_outcomes_total") == 1
    # A later caller that can reconcile settles it without calling.
    result = effects.run(
        engine, key=key, payload=ARGS, call=refund_via(client), reconcile=reconcile_via(client)
    )
    assert result["idempotency_key"] == key and requests(provider) == sent  # a GET only
    assert record(engine, settings, key).state == "done"


def test_permanent_error_is_stored_and_replayed(
    effects: Effects,
    engine: Engine,
    settings: OutboxSettings,
    provider: FakeProvider,
    client: ProviderClient,
) -> None:
    key, before = new_key(), provider.effects
    provider.fail_next("reject")
    with pytest.raises(EffectFailed) as first:
        effects.run(engine, key=key, payload=ARGS, call=refund_via(client))
    assert not first.value.replayed and first.value.error["status"] == 422
    sent = requests(provider)
    with pytest.raises(EffectFailed) as second:
        effects.run(engine, key=key, payload=ARGS, call=refund_via(client))
    assert second.value.replayed and second.value.error == first.value.error
    assert requests(provider) == sent and provider.effects == before
    assert record(engine, settings, key).state == "failed"


def test_retryable_503_is_retried_with_the_same_key(
    effects: Effects, engine: Engine, provider: FakeProvider, client: ProviderClient
) -> None:
    key, before, sent = new_key(), provider.effects, requests(provider)
    provider.fail_next("unavailable", 2)
    keys: list[str] = []

    def call(k: str) -> Any:
        keys.append(k)
        return refund_via(client)(k)

    effects.run(engine, key=key, payload=ARGS, call=call)
    assert keys == [key] * 3 and provider.effects - before == 1
    assert requests(provider) - sent == 3


def test_retryable_exhausted_releases_the_key(
    effects: Effects, engine: Engine, settings: OutboxSettings
) -> None:
    key = new_key()
    closed = ProviderClient("http://127.0.0.1:9", timeout=0.5)  # nothing listens: refused
    with pytest.raises(OSError):
        effects.run(engine, key=key, payload=ARGS, call=refund_via(closed))
    assert record(engine, settings, key) is None, "nothing applied: the key can run again"


def test_same_key_other_arguments_is_a_conflict(
    effects: Effects,
    engine: Engine,
    provider: FakeProvider,
    client: ProviderClient,
    registry: CollectorRegistry,
) -> None:
    key = new_key()
    effects.run(engine, key=key, payload=ARGS, call=refund_via(client))
    sent = requests(provider)
    with pytest.raises(EffectConflict):
        effects.run(engine, key=key, payload={**ARGS, "amount": 1}, call=refund_via(client))
    assert requests(provider) == sent
    assert metric(registry, "outbox_effects_conflicts_total") == 1


def test_fifty_concurrent_callers_with_one_key_make_one_call(
    effects: Effects, engine: Engine, provider: FakeProvider, client: ProviderClient
) -> None:
    key, before = new_key(), provider.effects
    calls = 0
    lock = threading.Lock()
    start = threading.Barrier(50)
    outcomes: list[Any] = []

    def call(k: str) -> Any:
        nonlocal calls
        with lock:
            calls += 1
        time.sleep(0.3)  # the others arrive while the owner is calling
        return refund_via(client)(k)

    def caller() -> None:
        start.wait()
        try:
            outcomes.append(effects.run(engine, key=key, payload=ARGS, call=call))
        except EffectInProgress as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=caller) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(outcomes) == 50
    assert calls == 1 and provider.effects - before == 1
    results = [o for o in outcomes if not isinstance(o, EffectInProgress)]
    assert results and all(r == results[0] for r in results)
    # Afterwards every caller gets the one result.
    assert effects.run(engine, key=key, payload=ARGS, call=call) == results[0] and calls == 1


def test_caller_killed_between_call_and_done_is_reconciled(
    effects: Effects,
    engine: Engine,
    settings: OutboxSettings,
    provider: FakeProvider,
    client: ProviderClient,
) -> None:
    key, before, lease = new_key(), provider.effects, 1.5
    args = {"charge": CHARGE, "amount": AMOUNT}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.effects_crasher",
            settings.database_url.get_secret_value(),
            provider.url,
            key,
            str(lease),
        ],
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "CALLED"
        # The owner is alive and holds the row: in progress, however long it takes.
        with pytest.raises(EffectInProgress):
            effects.run(engine, key=key, payload=args, call=refund_via(client))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    assert record(engine, settings, key).state == "pending"
    assert provider.effects - before == 1

    def call(k: str) -> Any:
        return client.refund(CHARGE, AMOUNT, idempotency_key=k)

    deadline = time.monotonic() + lease + 10
    while True:
        try:
            result = effects.run(
                engine, key=key, payload=args, call=call, reconcile=reconcile_via(client)
            )
            break
        except EffectInProgress:  # the dead caller's lease has not run out yet
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert result["idempotency_key"] == key
    assert provider.effects - before == 1, "reconciled, not called again"
    row = record(engine, settings, key)
    assert row.state == "done" and row.attempts == 0


def test_breaker_open_is_not_retried_by_the_ledger(
    settings: OutboxSettings, engine: Engine, registry: CollectorRegistry
) -> None:
    effects = Effects(
        settings,
        policy=RetryPolicy(base_seconds=0.01, max_attempts=5),
        breaker=lambda name: CircuitBreaker(name, failure_threshold=1),
        registry=registry,
    )
    closed = ProviderClient("http://127.0.0.1:9", timeout=0.5)
    attempts = 0

    def call(k: str) -> Any:
        nonlocal attempts
        attempts += 1
        return refund_via(closed)(k)

    with pytest.raises(CircuitOpen):
        effects.run(engine, key=new_key(), payload=ARGS, call=call, dependency="down")
    assert attempts == 1, "the open circuit stopped the retries"
    assert metric(registry, "outbox_effects_breaker_state", dependency="down") == 2


async def test_window_expiry_and_cleanup_behave_as_documented(
    effects: Effects,
    engine: Engine,
    aengine: AsyncEngine,
    settings: OutboxSettings,
    provider: FakeProvider,
    client: ProviderClient,
) -> None:
    window = timedelta(seconds=1)
    key, parked = new_key(), new_key()
    calls: list[str] = []

    def call(k: str) -> Any:
        calls.append(k)
        return refund_via(client)(k)

    first = effects.run(engine, key=key, payload=ARGS, call=call, window=window)
    assert effects.run(engine, key=key, payload=ARGS, call=call, window=window) == first
    assert len(calls) == 1, "within the window: replayed"
    provider.fail_next("apply_then_die")
    with pytest.raises(EffectOutcomeUnknown):
        effects.run(engine, key=parked, payload=ARGS, call=call, window=window)
    await asyncio.sleep(1.2)

    # Past the window the record no longer counts: the key runs again, even before a
    # cleanup deleted it (the provider's own Idempotency-Key then answers with its first
    # refund: no new effect there).
    effects_before = provider.effects
    assert effects.run(engine, key=key, payload=ARGS, call=call, window=window) == first
    assert len(calls) == 3 and provider.effects == effects_before
    await asyncio.sleep(1.2)

    # `outbox cleanup` deletes done/failed records past their window, never unknown ones.
    retention = Retention(None, None, idempotency=False, effects=True)
    dry = await run_cleanup(aengine, settings, retention, dry_run=True)
    assert dry.total >= 1
    report = await run_cleanup(aengine, settings, retention)
    assert [r.target for r in report.results] == ["effects"] and report.total >= 1
    assert record(engine, settings, key) is None
    assert record(engine, settings, parked).state == "unknown"


def test_a_failing_reconcile_parks_the_key_as_unknown(
    effects: Effects,
    engine: Engine,
    settings: OutboxSettings,
    provider: FakeProvider,
    client: ProviderClient,
) -> None:
    key, before = new_key(), provider.effects
    provider.fail_next("apply_then_die")

    def broken(k: str) -> Any:
        raise ConnectionRefusedError(111, "status endpoint down")

    with pytest.raises(EffectOutcomeUnknown, match="reconcile failed"):
        effects.run(engine, key=key, payload=ARGS, call=refund_via(client), reconcile=broken)
    assert record(engine, settings, key).state == "unknown"
    assert provider.effects - before == 1


def test_a_reconcile_that_meets_a_database_outage_leaves_the_key_pending_not_parked(
    effects: Effects,
    engine: Engine,
    settings: OutboxSettings,
    provider: FakeProvider,
    client: ProviderClient,
) -> None:
    """A reconcile that reads its answer from a database and meets an outage there (a real
    server error with SQLSTATE 57P03, "cannot connect now") learned nothing about the
    effect: the key stays pending under its lease for the next caller to reconcile, instead
    of being parked for an operator; that caller settles it without calling again."""
    key, before = new_key(), provider.effects
    provider.fail_next("apply_then_die")

    def database_down(k: str) -> Any:
        with engine.connect() as conn:
            conn.execute(
                text(
                    "DO $$ BEGIN RAISE EXCEPTION 'the database system is starting up' "
                    "USING ERRCODE = '57P03'; END $$"
                )
            )

    with pytest.raises(OperationalError) as raised:  # the outage itself, not "unknown"
        effects.run(engine, key=key, payload=ARGS, call=refund_via(client), reconcile=database_down)
    assert raised.value.orig is not None and raised.value.orig.sqlstate == "57P03"
    assert record(engine, settings, key).state == "pending"
    with engine.begin() as conn:  # the lease runs out
        t = build_tables(settings).effects
        conn.execute(update(t).where(t.c.key == key).values(lease_until=func.now()))
    result = effects.run(
        engine, key=key, payload=ARGS, call=refund_via(client), reconcile=reconcile_via(client)
    )
    assert result is not None and record(engine, settings, key).state == "done"
    assert provider.effects - before == 1


def test_a_result_that_is_not_json_is_recorded_as_done_and_reported(
    effects: Effects, engine: Engine, settings: OutboxSettings
) -> None:
    key = new_key()
    with pytest.raises(EffectResultInvalid):
        effects.run(engine, key=key, payload=ARGS, call=lambda k: {"at": object()})
    assert record(engine, settings, key).state == "done"
    assert effects.run(engine, key=key, payload=ARGS, call=lambda k: pytest.fail("again")) is None


def test_an_empty_retry_budget_fails_fast_and_releases_the_key(
    settings: OutboxSettings, engine: Engine, provider: FakeProvider, client: ProviderClient
) -> None:
    effects = Effects(
        settings,
        policy=RetryPolicy(base_seconds=0.01, max_attempts=5),
        budget=RetryBudget(ratio=0, burst=0, min_per_second=0),
        registry=CollectorRegistry(),
    )
    key, sent = new_key(), requests(provider)
    provider.fail_next("unavailable")
    with pytest.raises(RetryBudgetExhausted):
        effects.run(engine, key=key, payload=ARGS, call=refund_via(client))
    assert requests(provider) - sent == 1
    assert record(engine, settings, key) is None


def test_a_claim_taken_over_before_its_call_is_lease_lost_and_calls_nothing(
    effects: Effects, settings: OutboxSettings, engine: Engine, registry: CollectorRegistry
) -> None:
    # The window between the claim's commit and the row lock: a second caller (here a real
    # concurrent transaction) takes the key over, as it may once the first one's lease has run
    # out. The first caller must notice and call nothing.
    key, calls = new_key(), []
    t = build_tables(settings).effects
    racing = sync_engine(settings)

    def take_over_before_the_lock(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
        if "FOR UPDATE" in statement and "lock_token" in statement:
            with engine.begin() as other:
                other.execute(update(t).where(t.c.key == key).values(lock_token=uuid.uuid4()))

    event.listen(racing, "before_cursor_execute", take_over_before_the_lock)
    try:
        with pytest.raises(EffectLeaseLost) as raised:
            effects.run(racing, key=key, payload=ARGS, call=calls.append)
    finally:
        racing.dispose()
    assert raised.value.retriable and calls == []
    row = record(engine, settings, key)
    assert row.state == "pending" and row.attempts == 0, "the new owner's claim is untouched"


def test_an_autocommit_engine_still_keeps_a_second_caller_off_the_key(
    effects: Effects, settings: OutboxSettings
) -> None:
    # Under AUTOCOMMIT the row lock would end with its statement, and a call outlasting its
    # lease would be made twice. The ledger runs its own connection in transactions.
    autocommit = sync_engine(settings, isolation_level="AUTOCOMMIT")
    key, calls, outcome = new_key(), [], {}

    def slow(_key: str) -> dict[str, str]:
        calls.append("owner")
        time.sleep(2.0)
        return {"by": "owner"}

    def owner() -> None:
        outcome["owner"] = effects.run(
            autocommit, key=key, payload=ARGS, call=slow, lease=timedelta(seconds=0.5)
        )

    thread = threading.Thread(target=owner)
    thread.start()
    try:
        time.sleep(1.0)  # the owner is calling, past its lease
        with pytest.raises(EffectInProgress):
            effects.run(
                autocommit,
                key=key,
                payload=ARGS,
                call=lambda _k: calls.append("second"),
                reconcile=lambda _k: NOT_APPLIED,
                lease=timedelta(seconds=0.5),
            )
    finally:
        thread.join(10)
        autocommit.dispose()
    assert calls == ["owner"] and outcome["owner"] == {"by": "owner"}


def test_a_connection_lost_during_the_backoff_calls_nothing_more(
    settings: OutboxSettings, engine: Engine
) -> None:
    # The owner's session dies while it waits to retry (an idle-in-transaction timeout, a
    # network cut): its row lock is gone, its lease too, and another caller reconciles and
    # calls. When the owner wakes, it must not call again.
    key, calls = new_key(), []
    table = build_tables(settings).effects.name
    owner_engine = sync_engine(settings)

    def refused_then_ok(_key: str) -> dict[str, int]:
        calls.append("owner")
        if calls.count("owner") == 1:
            raise ConnectionRefusedError(111, "connection refused")  # retryable
        return {"by": "owner"}

    def cut_and_take_over(_seconds: float) -> None:
        with engine.begin() as conn:
            killed = conn.execute(
                text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                    "AND state = 'idle in transaction' AND query LIKE :q"
                ),
                {"q": f"%{table}%"},
            ).scalar_one()
        assert killed == 1
        time.sleep(0.6)  # past the owner's lease
        second = Effects(settings, registry=CollectorRegistry())
        taken = second.run(
            engine,
            key=key,
            payload=ARGS,
            call=lambda _k: calls.append("second") or {"by": "second"},
            reconcile=lambda _k: NOT_APPLIED,
        )
        assert taken == {"by": "second"}

    owner = Effects(
        settings,
        policy=RetryPolicy(base_seconds=0.01, cap_seconds=0.01, max_attempts=3),
        registry=CollectorRegistry(),
        sleep=cut_and_take_over,
    )
    try:
        with pytest.raises(OutboxError):
            owner.run(
                owner_engine,
                key=key,
                payload=ARGS,
                call=refused_then_ok,
                reconcile=lambda _k: NOT_APPLIED,
                lease=timedelta(seconds=0.5),
            )
    finally:
        owner_engine.dispose()
    assert calls == ["owner", "second"]
    assert record(engine, settings, key).result == {"by": "second"}


def test_a_retry_after_longer_than_the_lease_ends_the_attempts_and_frees_the_key(
    effects: Effects, settings: OutboxSettings, engine: Engine
) -> None:
    # Waiting would hold the row lock in an idle transaction for a minute: stop instead,
    # with nothing applied (429 is retryable: not processed), and let the caller come back.
    key, calls = new_key(), []

    class Throttled(ConnectionRefusedError):
        retry_after = 60.0

    def throttled(_key: str) -> None:
        calls.append(1)
        raise Throttled(111, "slow down")

    started = time.monotonic()
    with pytest.raises(Throttled):
        effects.run(engine, key=key, payload=ARGS, call=throttled, lease=timedelta(seconds=5))
    assert time.monotonic() - started < 5 and calls == [1]
    assert record(engine, settings, key) is None


async def test_an_autocommit_async_engine_still_keeps_a_second_caller_off_the_key(
    effects: Effects, settings: OutboxSettings
) -> None:
    autocommit = async_engine(settings, isolation_level="AUTOCOMMIT")
    key, calls = new_key(), []

    async def slow(_key: str) -> dict[str, str]:
        calls.append("owner")
        await asyncio.sleep(2.0)
        return {"by": "owner"}

    async def second(_key: str) -> None:
        calls.append("second")

    owner = asyncio.create_task(
        effects.run_async(
            autocommit, key=key, payload=ARGS, call=slow, lease=timedelta(seconds=0.5)
        )
    )
    try:
        await asyncio.sleep(1.0)  # the owner is calling, past its lease
        with pytest.raises(EffectInProgress):
            await effects.run_async(
                autocommit,
                key=key,
                payload=ARGS,
                call=second,
                reconcile=lambda _k: asyncio.sleep(0, NOT_APPLIED),
                lease=timedelta(seconds=0.5),
            )
        assert await owner == {"by": "owner"}
    finally:
        await autocommit.dispose()
    assert calls == ["owner"]
