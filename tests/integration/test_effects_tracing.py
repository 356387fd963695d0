"""The effect ledger marks the caller's span: key, dependency, attempts, replays and
reconciliations. Run in a subprocess: a tracer provider can be set once per process, and
the rest of the session keeps tracing off."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from outbox.settings import OutboxSettings

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent(
    """
    import time, uuid
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from outbox.db import sync_engine
    from outbox.effects import NOT_APPLIED, Effects
    from outbox.resilience import RetryPolicy
    from outbox.settings import OutboxSettings

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    time.sleep(1.05)  # "tracing off" is cached for up to a second

    settings = OutboxSettings()
    engine = sync_engine(settings)
    effects = Effects(settings, policy=RetryPolicy(0.001, 0.002, 3), sleep=lambda s: None)
    key = f"refund-{uuid.uuid4()}"
    calls = []

    def refund(k):
        calls.append(k)
        if len(calls) == 1:
            raise TimeoutError("read timeout after the request was sent")  # ambiguous
        return {"refund": "re_1"}

    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("first"):
        effects.run(engine, key=key, call=refund, reconcile=lambda k: NOT_APPLIED,
                    payload={"amount": 5}, dependency="psp")
    with tracer.start_as_current_span("again"):
        effects.run(engine, key=key, call=refund, reconcile=lambda k: NOT_APPLIED,
                    payload={"amount": 5}, dependency="psp")
    spans = {s.name: dict(s.attributes) for s in exporter.get_finished_spans()}
    assert len(calls) == 2, calls
    assert spans["first"] == {
        "outbox.effect.key": key, "outbox.effect.dependency": "psp",
        "outbox.attempt": 2, "outbox.effect.reconciled": "not_applied",
    }, spans["first"]
    assert spans["again"] == {
        "outbox.effect.key": key, "outbox.effect.dependency": "psp",
        "outbox.effect.replayed": "done",
    }, spans["again"]
    print("ok")
    """
)


def test_the_callers_span_shows_the_key_attempts_reconciliation_and_replay(
    settings: OutboxSettings,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(
        OUTBOX_DATABASE_URL=settings.database_url.get_secret_value(),
        OUTBOX_KAFKA_BOOTSTRAP_SERVERS=settings.kafka_bootstrap_servers,
        PYTHONPATH=str(ROOT),
    )
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
