"""A relay and a consumer started as `outbox` subprocesses export, before any event, every
metric the Grafana dashboard and the alert rules name (counters at 0), and with
``--json-logs`` every line they print is one JSON object. The one exception is a consumer's
lag: its series are per assigned partition, so they appear with the assignment (a lag not
measured is unknown, never 0)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.acceptance.conftest import ROOT, Cli, SchemaFactory
from tests.support.kafka import create_topic

pytestmark = pytest.mark.acceptance

ASSETS = [
    ROOT / "deploy" / "grafana" / "outbox-dashboard.json",
    ROOT / "deploy" / "prometheus" / "alerts.yml",
]
TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def referenced(prefix: str) -> set[str]:
    """Every metric (sample) name with ``prefix`` in the dashboard and the alert rules."""
    names: set[str] = set()
    for asset in ASSETS:
        names |= set(re.findall(rf"\b{prefix}[a-z_]+", asset.read_text()))
    return names


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int, proc: subprocess.Popen[bytes], log: Path) -> dict[str, float]:
    """``{sample name with labels: value}`` once the daemon serves /metrics."""
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, f"daemon exited {proc.returncode}: {log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                body = r.read().decode()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def names(samples: dict[str, float]) -> set[str]:
    return {key.split("{", 1)[0] for key in samples}


def stop(proc: subprocess.Popen[bytes], log: Path) -> list[dict[str, object]]:
    """SIGTERM; the daemon exits 0; every line it printed is one JSON object."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    lines = []
    for raw in text.splitlines():
        try:
            lines.append(json.loads(raw))
        except ValueError:
            pytest.fail(f"not one JSON object: {raw!r}")
        assert TIMESTAMP.match(str(lines[-1]["ts"])), raw
    return lines


def run_and_scrape(
    cli: Cli,
    tmp_path: Path,
    name: str,
    *args: str,
    until: Callable[[dict[str, float]], bool] | None = None,
) -> tuple[dict[str, float], list[dict[str, object]], dict[str, float]]:
    """Start ``outbox ARGS --json-logs --metrics-port P``, scrape it at once (and again
    until ``until`` holds, if given), stop it. Returns the first and the last scrape."""
    port = _free_port()
    log = tmp_path / f"{name}.log"
    proc = cli.popen(*args, "--json-logs", "--metrics-port", str(port), log=log)
    try:
        samples = last = scrape(port, proc, log)
        deadline = time.monotonic() + 60
        while until is not None and not until(last):
            assert time.monotonic() < deadline, f"never true: {sorted(last)}"
            time.sleep(0.2)
            last = scrape(port, proc, log)
    finally:
        lines = stop(proc, log)
    return samples, lines, last


def counters_at_zero(
    samples: dict[str, float], prefix: str, examples: set[str], later: frozenset[str] = frozenset()
) -> set[str]:
    """Every ``prefix`` metric the dashboard and alerts name is exported (``examples``
    among them, so the search itself is checked), but for those only exported ``later``;
    every counter is 0. Returns the counters' sample keys."""
    wanted = referenced(prefix)
    assert examples <= wanted and later <= wanted
    assert wanted - later <= names(samples), wanted - later - names(samples)
    counters = {k: v for k, v in samples.items() if k.split("{")[0].endswith("_total")}
    assert counters and set(counters.values()) == {0.0}, counters
    return set(counters)


def test_relay_exports_every_referenced_metric_from_start(
    fresh_schema: SchemaFactory, tmp_path: Path
) -> None:
    settings = fresh_schema(lanes=8)
    cli = Cli(settings, (("OUTBOX_LOG_LEVEL", "INFO"),))
    samples, lines, _ = run_and_scrape(cli, tmp_path, "relay", "relay")
    counters = counters_at_zero(
        samples, "outbox_relay_", {"outbox_relay_published_total", "outbox_relay_lanes"}
    )
    assert "outbox_relay_errors_total{error=OperationalError}" in counters
    assert samples["outbox_relay_lanes{}"] == 8
    assert any(line["msg"] == "relay starting" and line["relay_id"] for line in lines)


def test_consumer_exports_every_referenced_metric_from_start(
    fresh_schema: SchemaFactory, tmp_path: Path
) -> None:
    settings = fresh_schema()
    topic = asyncio.run(create_topic(settings.kafka_bootstrap_servers))
    consumer = f"metrics-{uuid.uuid4().hex[:8]}"
    cli = Cli(
        settings,
        (
            ("OUTBOX_LOG_LEVEL", "INFO"),
            ("INBOX_TEST_CONSUMER", consumer),
            ("INBOX_TEST_TOPIC", topic),
        ),
    )
    lag = f"outbox_inbox_lag_records{{consumer={consumer},partition=0,topic={topic}}}"
    samples, lines, assigned = run_and_scrape(
        cli,
        tmp_path,
        "consumer",
        "consume",
        "tests.support.inbox_apps:app",
        until=lambda s: lag in s,
    )
    counters = counters_at_zero(
        samples,
        "outbox_inbox_",
        {"outbox_inbox_processed_total", "outbox_inbox_dead_lettered_total"},
        later=frozenset({"outbox_inbox_lag_records"}),
    )
    assert assigned[lag] == 0  # its partition assigned and fetched: an empty topic, no lag
    assert len(counters) == 8
    assert all(k.endswith(f"{{consumer={consumer}}}") for k in counters)
    # The CLI's own messages are JSON records too, their figures as fields.
    started = [line for line in lines if str(line["msg"]).startswith(f"consumer {consumer} on")]
    assert started and started[0]["topics"] == [topic]
    [stopped] = [line for line in lines if str(line["msg"]).startswith("stopped")]
    assert stopped["processed"] == 0 and stopped["consumer"] == consumer
