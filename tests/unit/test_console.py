"""The console's rules that need no database: where it may listen, login and tokens, the
guards in front of actions, headers, filters, the chart, the scrubbing of URLs."""

from __future__ import annotations

import datetime as dt
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from outbox.console import Backends, FailedRows, check_bind, create_app
from outbox.console.filters import BadFilter, DeadLetterQuery, letter_key, read_keys
from outbox.console.metrics import ConsoleMetrics
from outbox.console.sampler import Sampler
from outbox.console.security import Guard
from outbox.console.state import scrub
from outbox.errors import ConfigurationError
from outbox.ops.lag import LagReport
from outbox.settings import ConsoleSettings, OutboxSettings


class NoDeadLetters:
    """Fails the test if a guard let a request through to a store."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the store was called ({name}) behind a guard")


def _app(token: str | None = None, allow_actions: bool = True) -> httpx.AsyncClient:
    settings = OutboxSettings(
        console=ConsoleSettings(token=SecretStr(token) if token else None, token_name="alice")
    )
    failed = FailedRows(list=lambda t, n: ([], 0), retry=lambda ids: [], discard=lambda ids: [])
    backends = Backends(NoDeadLetters(), failed)  # type: ignore[arg-type]
    # The lifespan (the lag sampler) does not run: it would reach for the database.
    app = create_app(settings, backends, allow_actions=allow_actions)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_needs_no_token(host: str) -> None:
    check_bind(host, OutboxSettings())


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "console.internal"])
def test_anything_else_needs_a_token(host: str) -> None:
    with pytest.raises(ConfigurationError, match="OUTBOX_CONSOLE__TOKEN"):
        check_bind(host, OutboxSettings())
    check_bind(host, OutboxSettings(console=ConsoleSettings(token=SecretStr("t"))))


async def test_with_a_token_pages_need_it_and_the_login_sets_a_cookie_that_is_not_the_token() -> (
    None
):
    client = _app(token="s3cret-token")
    assert (await client.get("/healthz")).text == "ok"  # probes need no token
    anonymous = await client.get("/dead-letters")
    assert anonymous.status_code == 303 and anonymous.headers["location"] == "/login"
    assert (await client.post("/login", data={"token": "wrong"})).status_code == 401
    ok = await client.post("/login", data={"token": "s3cret-token"})
    assert ok.status_code == 303
    cookie = ok.headers["set-cookie"]
    assert "s3cret-token" not in cookie and "httponly" in cookie.lower()
    assert "samesite=strict" in cookie.lower()
    guard = Guard(
        OutboxSettings(console=ConsoleSettings(token=SecretStr("s3cret-token"))), _metrics()
    )
    assert guard.session_value() in cookie


async def test_action_posts_need_the_token_then_the_csrf_token() -> None:
    client = _app(token="tok")
    form = {"action": "purge", "scope": "filtered", "consumer": "c", "confirmed": "yes"}
    assert (await client.post("/dead-letters/action", data=form)).status_code == 401
    bearer = {"Authorization": "Bearer tok"}
    refused = await client.post("/dead-letters/action", data=form, headers=bearer)
    assert refused.status_code == 403 and "CSRF" in refused.text


async def test_read_only_refuses_actions_before_reading_the_form() -> None:
    client = _app(allow_actions=False)
    refused = await client.post("/failed/action", data={"action": "retry", "id": "1"})
    assert refused.status_code == 403 and "read-only" in refused.text


async def test_every_response_carries_the_security_headers() -> None:
    client = _app()
    for path in ("/healthz", "/static/console.css", "/login", "/nowhere"):
        headers = (await client.get(path)).headers
        assert "default-src 'none'" in headers["content-security-policy"], path
        assert headers["x-content-type-options"] == "nosniff"


def test_the_audit_line_names_the_token_holder(caplog: pytest.LogCaptureFixture) -> None:
    settings = OutboxSettings(console=ConsoleSettings(token=SecretStr("t"), token_name="bob"))
    guard = Guard(settings, _metrics())
    guard.audit("dlq.purge", 50, "scope=group")
    [line] = [r.getMessage() for r in caplog.records if r.name == "outbox.console.audit"]
    assert line == "console action by=bob action=dlq.purge items=50 scope=group"
    assert Guard(OutboxSettings(), _metrics()).who == "local"
    assert guard.metrics.actions.labels("dlq.purge")._value.get() == 1  # type: ignore[attr-defined]
    assert guard.metrics.items.labels("dlq.purge")._value.get() == 50  # type: ignore[attr-defined]


def test_filters_read_times_as_utc_and_refuse_nonsense() -> None:
    query = DeadLetterQuery.read({"consumer": " c ", "topic": "", "after": "2026-11-27T01:00"})
    assert query.values == {"consumer": "c", "after": "2026-11-27T01:00"}
    where = query.filter()
    assert where.consumer == "c" and where.topic is None
    assert where.after == dt.datetime(2026, 11, 27, 1, tzinfo=dt.UTC)
    with pytest.raises(BadFilter):
        DeadLetterQuery.read({"before": "yesterday"}).filter()


def test_selected_keys_survive_any_character() -> None:
    odd = ('c"1', "id,with/odd|chars\n")
    assert read_keys([letter_key(*odd)]) == (odd,)
    with pytest.raises(BadFilter):
        read_keys(["not json"])


def test_urls_are_blanked() -> None:
    text = "cannot reach postgresql+psycopg://u:pw@db:5432/x (timeout)"
    assert scrub(text) == "cannot reach <url> (timeout)"


def test_the_chart_keeps_one_hour_and_scales_to_the_largest_value() -> None:
    sampler = Sampler()
    t0 = 1_000_000.0
    for i, pending in enumerate([0, 50, 100]):
        report = LagReport(taken_at=dt.datetime.now(dt.UTC), mode="delete", lanes=1)
        report.topics = []
        sampler.add(report, at=t0 + i * 60)
        sampler._samples[-1] = type(sampler._samples[-1])(t0 + i * 60, pending, 10)
    chart = sampler.chart(now=t0 + 120, width=100, height=10)
    assert chart.max_value == 100 and chart.samples == 3
    assert chart.pending_points.split()[-1] == "100.0,0.0"  # newest at the right, at the top
    sampler.add(LagReport(taken_at=dt.datetime.now(dt.UTC), mode="delete", lanes=1), at=t0 + 7200)
    assert len(sampler.samples) == 1  # older than an hour: dropped


def _metrics() -> ConsoleMetrics:
    return ConsoleMetrics(CollectorRegistry())


async def test_without_a_token_only_loopback_host_names_are_answered() -> None:
    client = _app()
    assert (await client.get("/healthz")).status_code == 200
    rebound = await client.get("/healthz", headers={"Host": "evil.example:8090"})
    assert rebound.status_code == 400
    with_token = _app(token="t")
    assert (await with_token.get("/healthz", headers={"Host": "console.internal"})).text == "ok"
