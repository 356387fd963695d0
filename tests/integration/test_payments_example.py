"""The payments example over real HTTP (uvicorn on loopback) and real PostgreSQL.

Every scenario checks the three things that must commit or roll back together: the refund
row (domain), its ``refund.created`` outbox row, and the idempotency record.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, func, select

from examples.payments.app import TOPIC, charges, create_app, refunds
from outbox import build_tables
from outbox.idempotency import scope_for
from outbox.settings import OutboxSettings
from tests.support.http import Server, free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


class Faults:
    """The example's fault hook, scripted by the tests (runs in the server's thread)."""

    def __init__(self) -> None:
        self.delay = 0.0
        self.fail_next = 0

    async def __call__(self, refund_id: str) -> None:
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail_next > 0:
            self.fail_next -= 1
            raise ConnectionResetError("payment provider reset the connection")


@pytest.fixture(scope="module")
def faults() -> Faults:
    return Faults()


@pytest.fixture(scope="module")
def server(settings: OutboxSettings, faults: Faults) -> Iterator[Server]:
    with Server(create_app(settings, fault=faults)) as running:
        yield running


@pytest.fixture
def client(server: Server, faults: Faults) -> Iterator[httpx.Client]:
    faults.delay, faults.fail_next = 0.0, 0
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


@pytest.fixture
def tenant() -> str:
    return f"tenant-{uuid.uuid4().hex[:8]}"


def _charge(client: httpx.Client, tenant: str, amount: int = 5000) -> str:
    r = client.post(
        "/charges",
        json={"amount": amount},
        headers={"X-Tenant-Id": tenant, "Idempotency-Key": f"charge-{uuid.uuid4()}"},
    )
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _refund(
    client: httpx.Client, tenant: str, key: str | None, body: dict[str, Any]
) -> httpx.Response:
    headers = {"X-Tenant-Id": tenant}
    if key is not None:
        headers["Idempotency-Key"] = key
    return client.post("/refunds", json=body, headers=headers)


def _state(engine: Engine, settings: OutboxSettings, tenant: str, key: str) -> dict[str, Any]:
    """Refund rows, their outbox rows, the charge's refunded total and the key's record."""
    t = build_tables(settings)
    with engine.connect() as conn:
        refund_ids = (
            conn.execute(select(refunds.c.id).where(refunds.c.tenant == tenant)).scalars().all()
        )
        events = conn.execute(
            select(func.count())
            .select_from(t.events)
            .where(
                t.events.c.topic == TOPIC,
                t.events.c.event_type == "refund.created",
                t.events.c.payload.contains(tenant.encode()),
            )
        ).scalar_one()
        refunded = conn.execute(
            select(func.coalesce(func.sum(charges.c.refunded), 0)).where(charges.c.tenant == tenant)
        ).scalar_one()
        record = conn.execute(
            select(t.idempotency.c.status, t.idempotency.c.response_body).where(
                t.idempotency.c.scope == scope_for(tenant, "POST /refunds"),
                t.idempotency.c.key == key,
            )
        ).first()
    return {"refunds": len(refund_ids), "events": events, "refunded": refunded, "record": record}


# ----------------------------------------------------------------------- scenarios


def test_created_replayed_and_conflict_over_http(
    client: httpx.Client, engine: Engine, settings: OutboxSettings, tenant: str
) -> None:
    charge = _charge(client, tenant)
    a = {"charge_id": charge, "amount": 1000, "client_sent_at": "12:00:00"}

    first = _refund(client, tenant, "k1", a)
    assert first.status_code == 201, first.text
    assert first.headers["idempotency-status"] == "stored"
    state = _state(engine, settings, tenant, "k1")
    assert (state["refunds"], state["events"], state["refunded"]) == (1, 1, 1000)
    assert state["record"].status == "complete" and state["record"].response_body == first.content

    # The client re-stamps its retry: a volatile field, so still the same request.
    again = _refund(client, tenant, "k1", {**a, "client_sent_at": "12:00:05"})
    assert again.status_code == 201
    assert again.headers["idempotency-status"] == "replayed"
    assert again.content == first.content
    assert again.headers["content-type"] == first.headers["content-type"]

    # Key order and 1000.0 vs 1000 do not make another request: the hash is canonical.
    reordered = client.post(
        "/refunds",
        content=f'{{"amount": 1000.0, "charge_id": "{charge}", "client_sent_at": "x"}}',
        headers={
            "X-Tenant-Id": tenant,
            "Idempotency-Key": "k1",
            "Content-Type": "application/json",
        },
    )
    assert reordered.headers["idempotency-status"] == "replayed"
    assert reordered.content == first.content

    other = _refund(client, tenant, "k1", {**a, "amount": 2000})
    assert other.status_code == 422
    assert other.json()["error"]["code"] == "idempotency.payload_mismatch"
    state = _state(engine, settings, tenant, "k1")
    assert (state["refunds"], state["events"], state["refunded"]) == (1, 1, 1000)


def test_json_without_canonical_form_is_identified_by_its_bytes(
    client: httpx.Client, tenant: str
) -> None:
    """An integer beyond 2**53 has no RFC 8785 form: such a body is hashed byte for byte,
    so its exact retry is replayed and a body differing in that integer is a conflict."""
    charge = _charge(client, tenant)
    headers = {"X-Tenant-Id": tenant, "Idempotency-Key": "big", "Content-Type": "application/json"}

    def post(reference: int) -> httpx.Response:
        body = f'{{"charge_id": "{charge}", "amount": 10, "reference": {reference}}}'
        return client.post("/refunds", content=body, headers=headers)

    first = post(2**60)
    assert first.status_code == 201, first.text
    again = post(2**60)
    assert again.headers["idempotency-status"] == "replayed"
    assert again.content == first.content
    conflict = post(2**60 + 1)
    assert conflict.status_code == 422
    assert conflict.json()["error"]["code"] == "idempotency.payload_mismatch"


def test_missing_or_invalid_key_and_missing_tenant_write_nothing(
    client: httpx.Client, engine: Engine, settings: OutboxSettings, tenant: str
) -> None:
    charge = _charge(client, tenant)
    body = {"charge_id": charge, "amount": 10}
    missing = _refund(client, tenant, None, body)
    assert (missing.status_code, missing.json()["error"]["code"]) == (
        400,
        "idempotency.key_required",
    )
    too_long = _refund(client, tenant, "k" * 256, body)
    assert (too_long.status_code, too_long.json()["error"]["code"]) == (
        400,
        "idempotency.invalid_key",
    )
    anonymous = client.post("/refunds", json=body, headers={"Idempotency-Key": "k1"})
    assert anonymous.status_code == 401
    assert _state(engine, settings, tenant, "k1")["refunds"] == 0


def test_same_key_from_two_tenants_never_collides(
    client: httpx.Client, engine: Engine, settings: OutboxSettings
) -> None:
    tenants = [f"tenant-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    for t in tenants:
        charge = _charge(client, t)
        r = _refund(client, t, "shared-key", {"charge_id": charge, "amount": 5})
        assert (r.status_code, r.headers["idempotency-status"]) == (201, "stored")
    assert [_state(engine, settings, t, "shared-key")["refunds"] for t in tenants] == [1, 1]


async def test_fifty_concurrent_requests_with_one_key_refund_once(
    server: Server, faults: Faults, engine: Engine, settings: OutboxSettings, tenant: str
) -> None:
    with httpx.Client(base_url=server.url) as sync_client:
        charge = _charge(sync_client, tenant)
    faults.delay, faults.fail_next = 0.3, 0
    body = {"charge_id": charge, "amount": 700}
    headers = {"X-Tenant-Id": tenant, "Idempotency-Key": "k-concurrent"}
    limits = httpx.Limits(max_connections=60)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=limits) as c:
            responses = await asyncio.gather(
                *(c.post("/refunds", json=body, headers=headers) for _ in range(50))
            )
    finally:
        faults.delay = 0.0
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {201, 409}, statuses
    created = [r for r in responses if r.status_code == 201]
    in_progress = [r for r in responses if r.status_code == 409]
    assert len({r.content for r in created}) == 1, "every 201 carries the one refund"
    assert sum(r.headers["idempotency-status"] == "stored" for r in created) == 1
    assert all(r.json()["error"]["code"] == "idempotency.in_progress" for r in in_progress)
    assert all(int(r.headers["retry-after"]) >= 1 for r in in_progress)
    state = _state(engine, settings, tenant, "k-concurrent")
    assert (state["refunds"], state["events"], state["refunded"]) == (1, 1, 700)


def test_transient_failure_rolls_back_all_three_and_the_retry_runs_once(
    client: httpx.Client, faults: Faults, engine: Engine, settings: OutboxSettings, tenant: str
) -> None:
    charge = _charge(client, tenant)
    body = {"charge_id": charge, "amount": 300}
    faults.fail_next = 1
    failed = _refund(client, tenant, "k1", body)
    assert failed.status_code == 503
    assert failed.json()["error"]["code"] == "unavailable"
    state = _state(engine, settings, tenant, "k1")
    assert (state["refunds"], state["events"], state["refunded"], state["record"]) == (
        0,
        0,
        0,
        None,
    )

    retried = _refund(client, tenant, "k1", body)
    assert (retried.status_code, retried.headers["idempotency-status"]) == (201, "stored")
    replay = _refund(client, tenant, "k1", body)
    assert replay.headers["idempotency-status"] == "replayed"
    state = _state(engine, settings, tenant, "k1")
    assert (state["refunds"], state["events"], state["refunded"]) == (1, 1, 300)


def test_final_failure_is_stored_and_replayed(
    client: httpx.Client, engine: Engine, settings: OutboxSettings, tenant: str
) -> None:
    charge = _charge(client, tenant, amount=100)
    body = {"charge_id": charge, "amount": 101}
    first = _refund(client, tenant, "k1", body)
    assert first.status_code == 422
    assert first.json()["error"]["code"] == "refund.amount_exceeds_charge"
    again = _refund(client, tenant, "k1", body)
    assert (again.status_code, again.headers["idempotency-status"]) == (422, "replayed")
    assert again.content == first.content
    state = _state(engine, settings, tenant, "k1")
    assert state["record"].status == "failed"
    assert (state["refunds"], state["events"], state["refunded"]) == (0, 0, 0)


def test_expired_key_is_treated_as_new(
    settings: OutboxSettings, engine: Engine, tenant: str
) -> None:
    app = create_app(settings, idempotency_ttl=timedelta(seconds=0.5))
    with Server(app) as short, httpx.Client(base_url=short.url, timeout=30) as c:
        charge = _charge(c, tenant)
        body = {"charge_id": charge, "amount": 50}
        first = _refund(c, tenant, "k1", body)
        time.sleep(0.7)
        second = _refund(c, tenant, "k1", body)
    assert (first.status_code, second.status_code) == (201, 201)
    assert second.headers["idempotency-status"] == "stored"
    assert first.json()["id"] != second.json()["id"]
    state = _state(engine, settings, tenant, "k1")
    assert (state["refunds"], state["events"], state["refunded"]) == (2, 2, 100)


def test_server_killed_mid_request_then_a_retry_refunds_once(
    client: httpx.Client, settings: OutboxSettings, engine: Engine, tenant: str
) -> None:
    charge = _charge(client, tenant)
    body = {"charge_id": charge, "amount": 400}
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OUTBOX_DATABASE_URL": settings.database_url.get_secret_value(),
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "examples.payments",
            "--port",
            str(port),
            "--fault-delay",
            "120",
            "--lock-timeout",
            "2",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    doomed: list[Any] = []
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "example did not start"
                time.sleep(0.05)

        def send() -> None:
            try:
                with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
                    doomed.append(_refund(c, tenant, "k1", body))
            except httpx.HTTPError as exc:
                doomed.append(exc)

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while _state(engine, settings, tenant, "k1")["record"] is None:
            assert time.monotonic() < deadline, "the request never claimed its key"
            time.sleep(0.05)
        time.sleep(0.5)  # now inside the slow provider call, rows written, not committed
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    thread.join(10)
    assert isinstance(doomed[0], httpx.HTTPError), "the client never got an answer"
    state = _state(engine, settings, tenant, "k1")
    assert state["record"].status == "pending"
    assert (state["refunds"], state["events"], state["refunded"]) == (0, 0, 0)

    deadline = time.monotonic() + 15
    while True:
        retry = _refund(client, tenant, "k1", body)
        if retry.status_code != 409:
            break
        assert time.monotonic() < deadline, "the dead server's claim was never taken over"
        time.sleep(0.2)
    assert (retry.status_code, retry.headers["idempotency-status"]) == (201, "stored")
    state = _state(engine, settings, tenant, "k1")
    assert (state["refunds"], state["events"], state["refunded"]) == (1, 1, 400)
    assert state["record"].status == "complete"
