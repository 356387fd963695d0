"""examples/agent_tools: the seeds' four-refund incident reproduced without the ledger and
prevented with it, against the fake provider on real HTTP and real PostgreSQL; and the
example's command line end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine

from examples.agent_tools.agent import Journal, LedgerRefundTool, UnguardedRefundTool
from examples.agent_tools.client import ProviderClient
from examples.agent_tools.incident import AMOUNT, CHARGE, replay_incident
from examples.agent_tools.provider import FakeProvider
from outbox.effects import Effects
from outbox.resilience import RetryPolicy
from outbox.settings import OutboxSettings

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def provider() -> Iterator[FakeProvider]:
    with FakeProvider() as p:
        yield p


def test_without_the_ledger_the_incident_makes_four_refunds(
    provider: FakeProvider, tmp_path: Path
) -> None:
    result = replay_incident(provider, tmp_path, UnguardedRefundTool(ProviderClient(provider.url)))
    assert result.effects == 4
    assert result.run.restarts == 3
    assert result.run.answer.startswith(f"Refunded {AMOUNT} on {CHARGE}")


def test_with_the_ledger_the_incident_makes_one_refund(
    provider: FakeProvider, tmp_path: Path, settings: OutboxSettings, engine: Engine
) -> None:
    effects = Effects(
        settings,
        policy=RetryPolicy(base_seconds=0.05, cap_seconds=0.2),
        registry=CollectorRegistry(),
    )
    tool = LedgerRefundTool(ProviderClient(provider.url), effects, engine)
    result = replay_incident(provider, tmp_path, tool, crash_after_first_tool=True)
    assert result.effects == 1
    # It crashed once after the refund returned and resumed from its journal; the model
    # re-emitted the same refund (worded differently) and the ledger replayed it.
    assert result.run.restarts == 1
    (journal_path,) = tmp_path.glob("journal-*.jsonl")
    calls = [e for e in Journal(journal_path).entries() if e["type"] == "tool_call"]
    assert len(calls) == 2 and calls[0]["step"] == calls[1]["step"] == 1
    assert calls[0]["args"]["reason"] != calls[1]["args"]["reason"]
    results = [e for e in Journal(journal_path).entries() if e["type"] == "tool_result"]
    assert len(results) == 1 and results[0]["content"]["id"] in result.run.answer


def test_the_example_runs_from_the_command_line(settings: OutboxSettings) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(
        OUTBOX_DATABASE_URL=settings.database_url.get_secret_value(),
        PYTHONPATH=str(ROOT),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "examples.agent_tools"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "without the ledger: 4 refunds" in proc.stdout
    assert "with the ledger:    1 refund" in proc.stdout
