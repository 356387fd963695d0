"""Pure parts of `outbox lag`: rates from offset samples, thresholds, totals, JSON."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from cli.ops import _lanes
from cli.params import parse_duration, shown
from outbox.ops.lag import (
    RATE_WINDOW_SECONDS,
    GroupLag,
    LagReport,
    PartitionLag,
    RateTracker,
    RelayInfo,
    Thresholds,
    TopicLag,
)


def report() -> LagReport:
    now = datetime(2025, 1, 1, tzinfo=UTC)
    return LagReport(
        taken_at=now,
        mode="delete",
        lanes=8,
        topics=[
            TopicLag("a", pending=5, due=5, oldest_pending_age_seconds=12.5, failed=1),
            TopicLag("b", pending=2, due=1, oldest_pending_age_seconds=90.0),
            TopicLag("c", pending=1, due=0, oldest_pending_age_seconds=None),
        ],
        groups=[GroupLag("g", [PartitionLag("a", 0, 10, 4, 6), PartitionLag("a", 1, 3, None, 3)])],
        relays=[
            RelayInfo("r1", "h", 1, now, 0.5, [0, 1, 2], alive=True),
            RelayInfo("r2", "h", 2, now, 99.0, [3, 4], alive=False),
        ],
    )


def test_totals_take_the_worst_age_and_ignore_topics_without_due_rows() -> None:
    r = report()
    assert (r.pending, r.failed, r.oldest_pending_age_seconds) == (8, 1, 90.0)
    assert r.unowned_lanes == [3, 4, 5, 6, 7]  # a stale relay's lanes are not owned
    assert r.consumer_lag == 9


def test_to_dict_is_json_and_carries_totals() -> None:
    data = json.loads(json.dumps(report().to_dict()))
    assert data["totals"]["pending"] == 8
    assert data["groups"][0]["total_lag"] == 9
    assert data["relays"][0]["started_at"].startswith("2025-01-01")


@pytest.mark.parametrize(
    ("thresholds", "expected"),
    [
        (Thresholds(), 0),
        (Thresholds(max_age_seconds=90.0), 0),  # equal is not over
        (Thresholds(max_age_seconds=89.9), 1),
        (Thresholds(max_pending=8), 0),
        (Thresholds(max_pending=7), 1),
        (Thresholds(max_consumer_lag=8, max_pending=0, max_age_seconds=1), 3),
    ],
)
def test_thresholds(thresholds: Thresholds, expected: int) -> None:
    assert len(thresholds.breaches(report())) == expected


def test_rate_needs_two_samples_and_uses_the_oldest_in_the_window() -> None:
    rates = RateTracker()
    rates.add({"t": 100}, at=0.0)
    assert rates.rate("t") is None
    rates.add({"t": 160}, at=2.0)
    assert rates.rate("t") == (30.0, 2.0)
    rates.add({"t": 400}, at=10.0)
    assert rates.rate("t") == (30.0, 10.0)
    assert rates.rate("other") is None


def test_rate_forgets_samples_older_than_the_window() -> None:
    rates = RateTracker()
    for second in range(0, 200, 10):
        rates.add({"t": second * 5}, at=float(second))
    per_second, covered = rates.rate("t")  # type: ignore[misc]
    assert per_second == pytest.approx(5.0)
    assert covered <= RATE_WINDOW_SECONDS + 10


def test_rate_never_negative_after_a_topic_is_recreated() -> None:
    rates = RateTracker()
    rates.add({"t": 500}, at=0.0)
    rates.add({"t": 10}, at=1.0)
    assert rates.rate("t") == (0.0, 1.0)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90.0), ("90s", 90.0), ("15m", 900.0), ("36h", 129600.0), ("7d", 604800.0),
     ("1.5h", 5400.0)],
)  # fmt: skip
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "-5m", "5w", "1h30m"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration like 90s, 30m, 12h or 30d"):
        parse_duration(text)


def test_durations_are_shown_in_the_largest_unit_that_divides_them() -> None:
    assert [shown(s) for s in (2_592_000, 43_200, 1800, 90, 1.5, 0)] == [
        "30d",
        "12h",
        "30m",
        "90s",
        "1.5s",
        "0s",
    ]


def test_lane_ranges() -> None:
    assert _lanes([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert _lanes([]) == "-"
