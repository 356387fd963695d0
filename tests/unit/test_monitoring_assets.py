"""The alert rules: valid for promtool, and the lane count comes from a metric."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"


def _rules() -> dict[str, Any]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"]}


def test_unowned_lanes_compares_with_the_exported_lane_count() -> None:
    expr = _rules()["OutboxLanesUnowned"]["expr"]
    assert re.search(r"sum\(outbox_relay_owned_lanes\) < on\(\) max\(outbox_relay_lanes\)", expr)


def test_the_held_snapshot_rule_needs_both_an_old_snapshot_and_dead_outbox_rows() -> None:
    expr = " ".join(_rules()["OutboxSnapshotHeld"]["expr"].split())
    assert "max(outbox_relay_oldest_snapshot_age_seconds) > 600" in expr
    assert "and on() max(outbox_relay_outbox_dead_rows) > 0" in expr


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_alert_rules_pass_promtool() -> None:
    proc = subprocess.run(
        ["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


DASHBOARD = ROOT / "deploy" / "grafana" / "outbox-dashboard.json"


def test_consumer_lag_comes_from_the_consumers_with_kafka_exporter_as_fallback() -> None:
    expr = _rules()["InboxConsumerLagHigh"]["expr"]
    own, fallback = re.split(r"\sor\s", expr)
    assert "outbox_inbox_lag_records" in own and "kafka_consumergroup_lag" in fallback
    panels = json.loads(DASHBOARD.read_text())["panels"]
    lag = next(p for p in panels if p.get("title") == "Consumer lag (records)")
    own, fallback = re.split(r"\sor\s", lag["targets"][0]["expr"])
    assert "outbox_inbox_lag_records" in own and "kafka_consumergroup_lag" in fallback


LAG_TESTS = """
rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      # billing exports its own lag; the exporter's (stale) figure for it must not count.
      - series: 'outbox_inbox_lag_records{{consumer="billing",topic="orders",partition="0"}}'
        values: '6000x20'
      - series: 'outbox_inbox_lag_records{{consumer="billing",topic="orders",partition="1"}}'
        values: '6000x20'
      - series: 'kafka_consumergroup_lag{{consumergroup="billing",topic="orders",partition="0"}}'
        values: '1x20'
      # shipping exports none (an older consumer): the exporter's figure is used.
      - series: 'kafka_consumergroup_lag{{consumergroup="shipping",topic="orders",partition="0"}}'
        values: '20000x20'
      # mail is fine.
      - series: 'outbox_inbox_lag_records{{consumer="mail",topic="orders",partition="0"}}'
        values: '3x20'
      - series: 'up{{job="outbox-consumer"}}'
        values: '1x20'
    alert_rule_test:
      - eval_time: 15m
        alertname: InboxConsumerLagHigh
        exp_alerts:
          - exp_labels: {{severity: warning, consumer: billing}}
            exp_annotations:
              summary: "Consumer billing lags 12000 records"
              description: "Per-partition detail: `outbox lag --group billing`."
          - exp_labels: {{severity: warning, consumer: shipping}}
            exp_annotations:
              summary: "Consumer shipping lags 20000 records"
              description: "Per-partition detail: `outbox lag --group shipping`."
      - eval_time: 15m
        alertname: InboxConsumerDown
        exp_alerts: []
  - interval: 1m
    input_series:
      - series: 'up{{job="outbox-consumer"}}'
        values: '0x10'
    alert_rule_test:
      - eval_time: 8m
        alertname: InboxConsumerDown
        exp_alerts:
          - exp_labels: {{severity: critical}}
            exp_annotations:
              summary: "No inbox consumer is up: events are not being applied"
              description: "Start `outbox consume MODULE:ATTR`; `outbox lag` shows the backlog."
"""


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_lag_alert_fires_per_consumer_from_its_own_gauge_or_the_exporters(tmp_path: Path) -> None:
    promtool_test(tmp_path, LAG_TESTS)


def promtool_test(tmp_path: Path, tests: str) -> None:
    """Run promtool's rule unit tests ``tests`` (``{rules}``: the rules file) and pass."""
    path = tmp_path / "rule_tests.yml"
    path.write_text(tests.format(rules=json.dumps(str(ALERTS))))
    proc = subprocess.run(
        ["promtool", "test", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


WAL_TESTS = """
rule_files: [{rules}]
evaluation_interval: 1m
tests:
  # A slot nobody confirms: 2 GiB and 100 MiB more each minute.
  - interval: 1m
    input_series:
      - series: 'outbox_relay_wal_retained_bytes{{instance="r1"}}'
        values: '2147483648+104857600x40'
      - series: 'outbox_relay_wal_slot_status{{instance="r1"}}'
        values: '0x40'
      - series: 'outbox_relay_wal_safe_bytes{{instance="r1"}}'
        values: '-1x40'
    alert_rule_test:
      - eval_time: 10m
        alertname: OutboxWalSlotGrowing
        exp_alerts: []
      - eval_time: 35m
        alertname: OutboxWalSlotGrowing
        exp_alerts:
          - exp_labels: {{severity: warning}}
            exp_annotations:
              summary: "The WAL source's slot holds 5.418GiB of WAL and keeps growing"
              description: >-
                The relay is not confirming: `outbox lag` (slot bytes and seconds), the relay's
                log, `outbox doctor`. An unread slot holds WAL on the primary without bound.
      - eval_time: 35m
        alertname: OutboxWalSlotNearInvalidation
        exp_alerts: []
  # A large but steady slot (a relay confirming, lots of WAL from elsewhere): no alert.
  - interval: 1m
    input_series:
      - series: 'outbox_relay_wal_retained_bytes{{instance="r1"}}'
        values: '2147483648x40'
    alert_rule_test:
      - eval_time: 35m
        alertname: OutboxWalSlotGrowing
        exp_alerts: []
  # Bounded retention running out, then unreserved, then lost.
  - interval: 1m
    input_series:
      - series: 'outbox_relay_wal_safe_bytes{{instance="r1"}}'
        values: '4294967296 536870912x5'
      - series: 'outbox_relay_wal_slot_status{{instance="r1"}}'
        values: '0 0 0 2 2 3 3'
    alert_rule_test:
      - eval_time: 3m
        alertname: OutboxWalSlotNearInvalidation
        exp_alerts:
          - exp_labels: {{severity: critical}}
            exp_annotations:
              summary: "The WAL source's slot is 512MiB from being invalidated"
              description: >-
                Past max_slot_wal_keep_size PostgreSQL invalidates the slot and every event it
                has not confirmed is lost. Get the relay reading, or raise max_slot_wal_keep_size.
      - eval_time: 4m
        alertname: OutboxWalSlotUnreserved
        exp_alerts:
          - exp_labels: {{severity: critical}}
            exp_annotations:
              summary: "The WAL source's slot is unreserved: the next checkpoint may invalidate it"
              description: >-
                wal_status unreserved: its WAL is past max_slot_wal_keep_size's guarantee. Get
                the relay reading or raise max_slot_wal_keep_size now (docs/operations/wal-slot.md).
      - eval_time: 6m
        alertname: OutboxWalSlotLost
        exp_alerts:
          - exp_labels: {{severity: critical}}
            exp_annotations:
              summary: "The WAL source's slot was invalidated: unconfirmed events are lost"
              description: >-
                The relay stops (exit 2) naming the LSN since which events may be lost; follow
                docs/operations/wal-slot.md ("The slot is lost").
"""


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_wal_slot_alerts_fire_on_growth_and_on_unreserved_or_lost(tmp_path: Path) -> None:
    promtool_test(tmp_path, WAL_TESTS)
