"""`outbox effects list|show|resolve` as a subprocess against real PostgreSQL, with records
made by the ledger against the fake payment provider on loopback HTTP."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine

from examples.agent_tools.client import ProviderClient
from examples.agent_tools.provider import FakeProvider
from outbox.effects import EffectFailed, EffectOutcomeUnknown, Effects
from outbox.resilience import RetryPolicy
from outbox.settings import OutboxSettings
from tests.acceptance.conftest import Cli, SchemaFactory

pytestmark = pytest.mark.acceptance
ARGS = {"charge": "ch_cli", "amount": 700}


@pytest.fixture(scope="module")
def provider() -> Iterator[FakeProvider]:
    with FakeProvider() as p:
        yield p


@pytest.fixture
def schema(fresh_schema: SchemaFactory) -> OutboxSettings:
    return fresh_schema()


def effects_of(s: OutboxSettings) -> Effects:
    return Effects(s, policy=RetryPolicy(base_seconds=0.01), registry=CollectorRegistry())


def parked(engine: Engine, s: OutboxSettings, provider: FakeProvider) -> tuple[str, Any]:
    """An effect the provider applied while the caller lost the answer: state unknown."""
    client, key = ProviderClient(provider.url), f"cli-{uuid.uuid4()}"
    provider.fail_next("apply_then_die")
    with pytest.raises(EffectOutcomeUnknown):
        effects_of(s).run(
            engine,
            key=key,
            payload=ARGS,
            call=lambda k: client.refund(ARGS["charge"], ARGS["amount"], k),
        )
    return key, client.find_refund(key)


def no_traceback(proc: Any) -> None:
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout


def test_list_show_and_resolve_applied(
    schema: OutboxSettings, acceptance_engine: Engine, provider: FakeProvider
) -> None:
    engine, cli = acceptance_engine, Cli(schema)
    key, refund = parked(engine, schema, provider)
    other = ProviderClient(provider.url)
    provider.fail_next("reject")
    with pytest.raises(EffectFailed):
        effects_of(schema).run(
            engine, key="cli-failed", payload=ARGS, call=lambda k: other.refund("c", 1, k)
        )

    listed = cli.json("effects", "list", "--state", "unknown")
    assert [r["key"] for r in listed] == [key]
    assert listed[0]["state"] == "unknown"
    assert listed[0]["last_error"].startswith(("ConnectionResetError", "RemoteDisconnected"))
    assert {r["key"] for r in cli.json("effects", "list")} == {key, "cli-failed"}
    assert (
        cli.json("effects", "list", "--state", "failed", "--limit", "1")[0]["error"]["status"]
        == 422
    )
    human = cli("effects", "list", "--state", "unknown")
    assert human.returncode == 0 and key in human.stdout and human.stderr == "1 effect\n"

    shown = cli.json("effects", "show", key)
    assert shown["state"] == "unknown" and shown["dependency"] == "default"

    proc = cli("effects", "resolve", key, "--applied", json.dumps(refund))
    assert proc.returncode == 0, proc.stderr
    assert "resolved: applied" in proc.stderr
    assert cli.json("effects", "show", key)["state"] == "done"
    # From now on the stored result is replayed, nothing is called.
    result = effects_of(schema).run(
        engine, key=key, payload=ARGS, call=lambda k: pytest.fail("called again")
    )
    assert result == refund
    # A done effect cannot be resolved again.
    again = cli("effects", "resolve", key, "--not-applied")
    assert again.returncode == 1 and "only an unknown effect" in again.stderr
    no_traceback(again)


def test_resolve_not_applied_lets_the_next_caller_call(
    schema: OutboxSettings, acceptance_engine: Engine, provider: FakeProvider
) -> None:
    engine, cli = acceptance_engine, Cli(schema)
    key, _refund = parked(engine, schema, provider)
    proc = cli("effects", "resolve", key, "--not-applied")
    assert proc.returncode == 0, proc.stderr
    calls: list[str] = []

    def call(k: str) -> Any:
        calls.append(k)
        return {"ok": True}

    assert effects_of(schema).run(engine, key=key, payload=ARGS, call=call) == {"ok": True}
    assert calls == [key]


@pytest.mark.parametrize(
    ("args", "rc", "message"),
    [
        (("show", "no-such-key"), 1, "EffectNotFound: no effect with key no-such-key"),
        (("resolve", "no-such-key", "--not-applied"), 1, "no effect with key no-such-key"),
        (("resolve", "k", "--applied", "{not json"), 2, "UsageError: --applied is not valid JSON"),
        (("resolve", "k"), 2, "UsageError: give exactly one of --applied RESULT_JSON or"),
        (("resolve", "k", "--applied", "1", "--not-applied"), 2, "exactly one of"),
    ],
)
def test_bad_input_is_one_clear_line_exit_1_when_not_found_2_for_usage(
    schema: OutboxSettings, args: tuple[str, ...], rc: int, message: str
) -> None:
    proc = Cli(schema)("effects", *args)
    assert proc.returncode == rc, proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith("error: ") and message in line, line
    no_traceback(proc)


def test_bad_state_is_a_usage_error(schema: OutboxSettings) -> None:
    proc = Cli(schema)("effects", "list", "--state", "weird")
    assert proc.returncode == 2 and "weird" in proc.stderr
    no_traceback(proc)
