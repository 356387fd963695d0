"""The alert rules: valid for promtool, and the lane count comes from a metric."""

from __future__ import annotations

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
