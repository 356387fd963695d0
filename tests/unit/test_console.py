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
from outbox.console.charts import nice_step, sparkline, value_label
from outbox.console.filters import BadFilter, DeadLetterQuery, letter_key, read_keys
from outbox.console.metrics import ConsoleMetrics
from outbox.console.sampler import Sampler
from outbox.console.security import Guard, Sessions
from outbox.errors import ConfigurationError
from outbox.ops.consumers import GroupState, assignment
from outbox.ops.deadletters import DeadLetter
from outbox.ops.lag import LagReport
from outbox.scrub import scrub
from outbox.settings import ConsoleSettings, OutboxSettings


class NoDeadLetters:
    """Fails the test if a guard let a request through to a store."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the store was called ({name}) behind a guard")


TOKEN = "s3cret-token-of-22-chars"


def _app(token: str | None = None, allow_actions: bool = True, **console: Any) -> httpx.AsyncClient:
    settings = OutboxSettings(
        console=ConsoleSettings(
            token=SecretStr(token) if token else None, token_name="alice", **console
        )
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
    check_bind(host, OutboxSettings(console=ConsoleSettings(token=SecretStr(TOKEN))))


@pytest.mark.parametrize(
    ("token", "says"), [("", "set but empty"), ("   ", "set but empty"), ("x" * 10, "10 char")]
)
@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_an_empty_or_short_token_is_refused_wherever_it_binds(
    token: str, says: str, host: str
) -> None:
    settings = OutboxSettings(console=ConsoleSettings(token=SecretStr(token)))
    with pytest.raises(ConfigurationError, match=says) as refused:
        check_bind(host, settings)
    assert token.strip() == "" or token not in str(refused.value)
    with pytest.raises(ConfigurationError):
        Guard(settings, _metrics())  # create_app() refuses it too


def _session_cookie(response: httpx.Response) -> str:
    return response.cookies["outbox_console"]


async def test_with_a_token_pages_need_it_and_the_login_opens_a_random_session() -> None:
    client = _app(token=TOKEN)
    anonymous = await client.get("/dead-letters")
    assert anonymous.status_code == 303 and anonymous.headers["location"] == "/login"
    assert (await client.post("/login", data={"token": "wrong"})).status_code == 401
    ok = await client.post("/login", data={"token": TOKEN})
    assert ok.status_code == 303
    header = ok.headers["set-cookie"].lower()
    assert TOKEN.lower() not in header and "httponly" in header
    assert "samesite=strict" in header and "max-age=28800" in header  # 8 h by default
    again = await _app(token=TOKEN).post("/login", data={"token": TOKEN})
    assert _session_cookie(ok) != _session_cookie(again)  # random, not derived from the token
    assert len(_session_cookie(ok)) >= 40


async def test_a_session_ends_at_logout_and_is_unknown_to_another_process() -> None:
    client = _app(token=TOKEN)
    await client.post("/login", data={"token": TOKEN})
    page = await client.get("/dead-letters?page=abc")
    assert page.status_code == 400  # past the guard (and no database needed)
    cookie = client.cookies["outbox_console"]
    # Another console (a restart, e.g. with a new token) does not know the session.
    other = _app(token="another-token-of-24-chars")
    other.cookies.set("outbox_console", cookie)
    assert (await other.get("/dead-letters")).status_code == 303
    # Logging out needs the session's CSRF token, then ends the session.
    assert (await client.post("/logout", data={"csrf": "forged"})).status_code == 403
    guard = client._transport.app.state.console.guard  # type: ignore[attr-defined]
    session = guard.sessions.get(cookie)
    out = await client.post("/logout", data={"csrf": session.csrf})
    assert out.status_code == 303 and out.headers["location"] == "/login"
    stale = httpx.AsyncClient(transport=client._transport, base_url="http://127.0.0.1")
    stale.cookies.set("outbox_console", cookie)
    assert (await stale.get("/dead-letters")).status_code == 303
    assert guard.sessions.get(cookie) is None


def test_a_session_expires(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr("outbox.console.security.time.monotonic", lambda: clock[0])
    sessions = Sessions(ttl_seconds=3600)
    session_id, session = sessions.open("alice")
    assert sessions.get(session_id) is session
    clock[0] += 3599
    assert sessions.get(session_id) is session
    clock[0] += 2
    assert sessions.get(session_id) is None and len(sessions) == 0


def test_sessions_are_bounded_oldest_first() -> None:
    sessions = Sessions(ttl_seconds=60, limit=3)
    ids = [sessions.open("a")[0] for _ in range(4)]
    assert sessions.get(ids[0]) is None and all(sessions.get(i) for i in ids[1:])


async def test_action_posts_need_the_token_then_the_sessions_csrf_token() -> None:
    client = _app(token=TOKEN)
    form = {"action": "purge", "scope": "filtered", "consumer": "c", "confirmed": "yes"}
    assert (await client.post("/dead-letters/action", data=form)).status_code == 401
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    refused = await client.post("/dead-letters/action", data=form, headers=bearer)
    assert refused.status_code == 403 and "CSRF" in refused.text
    # One session's CSRF token is no good in another session.
    first, second = _app(token=TOKEN), None
    await first.post("/login", data={"token": TOKEN})
    guard = first._transport.app.state.console.guard  # type: ignore[attr-defined]
    _, other = guard.sessions.open("alice")
    second = await first.post("/dead-letters/action", data={**form, "csrf": other.csrf})
    assert second.status_code == 403 and "CSRF" in second.text


async def test_without_a_token_the_first_page_opens_a_session_for_its_csrf_token() -> None:
    client = _app()
    page = await client.get("/nowhere-page")
    assert page.status_code == 404
    page = await client.get("/failed")
    cookie = _session_cookie(page)
    guard = client._transport.app.state.console.guard  # type: ignore[attr-defined]
    assert guard.sessions.get(cookie).csrf in page.text


async def test_read_only_refuses_actions_before_reading_the_form() -> None:
    client = _app(allow_actions=False)
    refused = await client.post("/failed/action", data={"action": "retry", "id": "1"})
    assert refused.status_code == 403 and "read-only" in refused.text


async def test_every_response_carries_the_security_headers() -> None:
    client = _app()
    for path in ("/static/console.css", "/login", "/nowhere"):
        headers = (await client.get(path)).headers
        assert "default-src 'none'" in headers["content-security-policy"], path
        assert headers["x-content-type-options"] == "nosniff"


def test_the_audit_line_names_the_token_holder(caplog: pytest.LogCaptureFixture) -> None:
    settings = OutboxSettings(console=ConsoleSettings(token=SecretStr(TOKEN), token_name="bob"))
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


def test_urls_and_passwords_are_blanked() -> None:
    text = "cannot reach postgresql+psycopg://u:pw@db:5432/x (timeout)"
    assert scrub(text) == "cannot reach <url> (timeout)"
    assert scrub("host=db password=pw user=u") == "host=db password=<hidden> user=u"
    assert scrub("PASSWORD = pw") == "PASSWORD=<hidden>"


@pytest.mark.parametrize(
    "path",
    [
        "/dead-letters?topic=%00",
        "/dead-letters?consumer=a%00b",
        "/dead-letters?page=1000000000000000000",
        "/dead-letters?page=-1",
        "/dead-letters?page=abc",
        "/dead-letters?page=" + "9" * 5000,
        "/dead-letters?after=yesterday",
        "/dead-letters?before=2026-13-45",
        "/dead-letters/show?consumer=c&event_id=a%00b",
        "/effects/show?key=a%00b",
        "/failed?topic=%00",
        "/effects?state=%00",
        "/?x%00=1",
    ],
)
async def test_bad_query_parameters_are_a_400_with_a_short_message(path: str) -> None:
    response = await _app().get(path)
    assert response.status_code == 400, response.text[:300]
    message = response.text.split('<p class="error">')[1].split("</p>")[0]
    assert 0 < len(message) < 100 and "Traceback" not in response.text


def test_the_lag_chart_keeps_one_hour_and_has_axes_with_times_and_units() -> None:
    sampler = Sampler()
    t0 = 1_800_000_000.0  # 2027-01-15 08:00:00 UTC
    for i, pending in enumerate([0, 50, 100]):
        report = LagReport(taken_at=dt.datetime.now(dt.UTC), mode="delete", lanes=1)
        report.topics = []
        sampler.add(report, at=t0 + i * 60)
        sampler._samples[-1] = type(sampler._samples[-1])(t0 + i * 60, pending, 10)
    chart = sampler.chart(now=t0 + 120)
    assert chart.unit == "events" and not chart.empty
    assert [t.label for t in chart.y_ticks] == ["0", "50", "100"]  # round steps, from 0
    assert [t.label for t in chart.x_ticks] == [
        "07:10",
        "07:20",
        "07:30",
        "07:40",
        "07:50",
        "08:00",
    ]  # every 10 minutes of the hour shown, UTC
    pending = chart.lines[0]
    newest = pending.paths[0].split()[-1]
    assert newest == f"{chart.right:.1f},{chart.top:.1f}"  # newest at the right, at the top
    assert pending.last == 100
    sampler.add(LagReport(taken_at=dt.datetime.now(dt.UTC), mode="delete", lanes=1), at=t0 + 7200)
    assert len(sampler.samples) == 1  # older than an hour: dropped


def test_round_steps_and_labels() -> None:
    tops = (1, 7, 40, 100, 999, 12_500)
    assert [nice_step(top) for top in tops] == [0.5, 2.0, 10.0, 50.0, 500.0, 5000.0]
    assert value_label(0) == "0" and value_label(2500) == "2.5k" and value_label(3e6) == "3M"


def test_a_sparkline_says_its_latest_and_highest_value_and_breaks_at_gaps() -> None:
    points = [(0.0, 1.0), (60.0, None), (120.0, 4.0), (180.0, 2.0)]
    spark = sparkline(points, start=0, end=180, unit="events/s")
    assert spark.summary == "now 2 events/s, peak 4 events/s (last hour)"
    assert len(spark.paths) == 2  # the gap splits the line
    assert sparkline([], start=0, end=60, unit="ms").summary == "no figures in the last hour"
    slow = sparkline([(0.0, 0.0333), (60.0, None)], start=0, end=60, unit="events/s")
    assert slow.summary == "now none, peak 0.033 events/s (last hour)"


def _metrics() -> ConsoleMetrics:
    return ConsoleMetrics(CollectorRegistry())


async def test_without_a_token_only_loopback_host_names_are_answered() -> None:
    client = _app()
    assert (await client.get("/login")).status_code == 200
    rebound = await client.get("/login", headers={"Host": "evil.example:8090"})
    assert rebound.status_code == 400
    with_token = _app(token=TOKEN)
    assert (await with_token.get("/login", headers={"Host": "console.internal"})).status_code == 200


def _letter(**kw: Any) -> DeadLetter:
    fields: dict[str, Any] = {
        "consumer": "billing",
        "event_id": "e1",
        "topic": "orders",
        "partition": 0,
        "offset": 7,
        "event_type": "order.placed",
        "key": b"k",
        "value": b'{"card": "4111-1111-1111-1111"}',
        "headers": (),
        "error_class": "Boom",
        "error_message": "boom",
        "attempts": 1,
        "dlq_topic": "orders.dlq",
        "dlq_partition": 0,
        "dlq_offset": 1,
        "dlq_refused": None,
        "dead_lettered_at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
        "replays": 0,
        "replayed_at": None,
        "inbox_status": "dead_lettered",
    }
    return DeadLetter(**{**fields, **kw})


class OneLetter:
    async def get(self, consumer: str, event_id: str) -> DeadLetter:
        return _letter()


@pytest.mark.parametrize(
    ("show", "actions", "shown"),
    [(False, True, False), (False, False, False), (True, False, False), (True, True, True)],
)
async def test_payloads_are_hidden_unless_the_setting_shows_them_to_the_operator(
    show: bool, actions: bool, shown: bool
) -> None:
    settings = OutboxSettings(console=ConsoleSettings(show_payloads=show))
    failed = FailedRows(list=lambda t, n: ([], 0), retry=lambda ids: [], discard=lambda ids: [])
    app = create_app(settings, Backends(OneLetter(), failed), allow_actions=actions)  # type: ignore[arg-type]
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")
    page = await client.get("/dead-letters/show?consumer=billing&event_id=e1")
    assert page.status_code == 200
    assert ("4111-1111-1111-1111" in page.text) is shown
    assert ("payload-hidden" in page.text) is not shown
    assert "(json, 31 bytes)" in page.text  # its kind and size are always said


def test_a_member_assignment_is_read_as_kafka_encodes_it() -> None:
    raw = (
        b"\x00\x00"  # version
        + b"\x00\x00\x00\x02"  # two topics
        + b"\x00\x06orders\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00\x01"
        + b"\x00\x01p\x00\x00\x00\x01\x00\x00\x00\x00"
        + b"\x00\x00\x00\x00"  # user data
    )
    assert assignment(raw) == (("orders", 1), ("orders", 3), ("p", 0))
    assert assignment(b"") == () and assignment(b"\x00\x00\x00\x00\x00\x09") == ()
    group = GroupState.of(
        {
            "state": "Stable",
            "members": [
                {
                    "member_id": "m-1",
                    "client_id": "c",
                    "client_host": "/10.0.0.7",
                    "member_assignment": raw,
                }
            ],
        }
    )
    assert group.members[0].host == "10.0.0.7"
