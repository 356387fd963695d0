"""inbox/membership.py without Kafka: options, the named code 82, telling a duplicate."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import errors as kerr

from inbox import membership
from inbox.errors import DuplicateInstanceId
from outbox import load_settings
from outbox.kafka.aiokafka_consumer import AioConsumer


def test_static_options_only_with_an_instance_id() -> None:
    assert membership.static_options(load_settings(), {}) == {}
    settings = load_settings(consumer={"group_instance_id": "c-{hostname}"})
    options = membership.static_options(settings, {})
    assert options["group_instance_id"].startswith("c-")
    assert options["session_timeout_ms"] == 45_000
    assert options["rebalance_timeout_ms"] == membership.REBALANCE_TIMEOUT_MS
    # The app's own kafka_options win.
    mine = membership.static_options(settings, {"session_timeout_ms": 20_000})
    assert "session_timeout_ms" not in mine


def test_code_82_gets_its_name() -> None:
    membership.register_fenced_error()
    error = kerr.for_code(membership.FENCED_INSTANCE_ID)()
    assert type(error).__name__ == "FencedInstanceIdError"
    # How aiokafka 0.14 raises a join's unexpected error: KafkaError(repr(error)).
    assert membership.is_fenced(kerr.KafkaError(repr(error)))
    assert not membership.is_fenced(kerr.KafkaError(repr(kerr.UnknownError())))


def test_session_refused_names_the_setting() -> None:
    refused = membership.session_refused(kerr.InvalidSessionTimeoutError(), 45_000, True)
    assert refused is not None and "STATIC_SESSION_TIMEOUT_MS" in str(refused)
    assert "InvalidSessionTimeoutError" in str(refused)  # the broker's error name stays
    dynamic = membership.session_refused(kerr.InvalidSessionTimeoutError(), 500, False)
    assert dynamic is not None and "kafka_options" in str(dynamic)
    assert membership.session_refused(kerr.KafkaError(), 45_000, True) is None


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _member(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, membership.Membership, _Clock]:
    clock = _Clock()
    monkeypatch.setattr(membership.time, "monotonic", clock)
    coordinator = SimpleNamespace(generation=1, resets=0)
    coordinator.reset_generation = lambda: setattr(coordinator, "resets", coordinator.resets + 1)
    kafka: Any = SimpleNamespace(_coordinator=coordinator)
    consumer = AioConsumer(kafka, load_settings())  # the client interface, on the fake
    return kafka, membership.Membership(consumer, "shipping", "shipping-0"), clock


def test_a_rebalance_is_no_duplicate(monkeypatch: pytest.MonkeyPatch) -> None:
    kafka, member, clock = _member(monkeypatch)
    assert member.joined() is None
    for generation in (2, 3, 4):
        clock.now += 1
        kafka._coordinator.generation = generation
        assert member.joined() is None


def test_the_newcomer_taken_over_at_its_generation_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    _kafka, member, clock = _member(monkeypatch)
    assert member.joined() is None  # its first join: took the member from the other
    clock.now += 4  # the other takes it back; this one joins again, same generation
    duplicate = member.joined()
    assert isinstance(duplicate, DuplicateInstanceId)
    assert "'shipping-0'" in str(duplicate) and "'shipping'" in str(duplicate)
    assert "OUTBOX_CONSUMER__GROUP_INSTANCE_ID" in str(duplicate)


def test_the_incumbent_takes_the_member_back_and_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    _kafka, member, clock = _member(monkeypatch)
    assert member.joined() is None
    clock.now += membership.NEWCOMER_SECONDS + 1
    assert member.joined() is None  # taken over by a newcomer: logged, kept
    clock.now += 1
    assert member.joined() is None  # the newcomer again (restarted by its orchestrator)


def _fenced() -> kerr.KafkaError:
    membership.register_fenced_error()
    return kerr.KafkaError(repr(kerr.for_code(membership.FENCED_INSTANCE_ID)()))


def test_a_fenced_incumbent_joins_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    kafka, member, clock = _member(monkeypatch)
    assert member.joined() is None
    clock.now += membership.NEWCOMER_SECONDS + 1
    assert member.survives(_fenced())
    assert kafka._coordinator.resets == 1  # no longer under the fenced member id
    assert not member.survives(kerr.KafkaError("something else"))


@pytest.mark.parametrize("joined_before", [True, False])
def test_a_fenced_newcomer_does_not_survive(
    monkeypatch: pytest.MonkeyPatch, joined_before: bool
) -> None:
    kafka, member, clock = _member(monkeypatch)
    if joined_before:
        assert member.joined() is None
    clock.now += 2
    assert not member.survives(_fenced())  # the daemon stops with DuplicateInstanceId
    assert kafka._coordinator.resets == 0


def test_slow_heartbeats_widen_the_newcomer_window() -> None:
    assert membership.newcomer_seconds(3000) == membership.NEWCOMER_SECONDS
    assert membership.newcomer_seconds(10_000) == 30.0


def test_the_client_interface_s_group_errors_keep_kafka_s_names() -> None:
    # outbox/kafka/aiokafka_consumer.py maps a fetch's group errors to GroupError, named.
    from outbox.errors import GroupError

    fenced = GroupError("KafkaError", str(kerr.KafkaError("FencedInstanceIdError()")))
    assert membership.is_fenced(fenced)
    assert not membership.is_fenced(GroupError("UnknownMemberIdError", "UnknownMemberIdError"))
    refused = GroupError("InvalidSessionTimeoutError", "InvalidSessionTimeoutError")
    assert membership.session_refused(refused, 45_000, True) is not None
