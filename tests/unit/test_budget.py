"""Retry budget: retries capped to a fraction of requests, with a fake clock."""

from __future__ import annotations

import pytest

from outbox.errors import ConfigurationError
from outbox.resilience.budget import RetryBudget


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_retries_are_capped_to_a_fraction_of_requests() -> None:
    budget = RetryBudget(ratio=0.1, burst=5, min_per_second=0, clock=Clock())
    assert sum(budget.try_spend() for _ in range(100)) == 5  # the initial burst
    for _ in range(1000):
        budget.record_request()
    # 1000 requests earn 100 tokens, but no more than the burst is ever saved up.
    assert sum(budget.try_spend() for _ in range(100)) == 5


def test_steady_state_allows_ratio_times_requests() -> None:
    budget = RetryBudget(ratio=0.2, burst=1000, min_per_second=0, clock=Clock())
    while budget.try_spend():
        pass
    allowed = 0
    for _ in range(500):
        budget.record_request()
        allowed += budget.try_spend()
    assert allowed == 100


def test_time_refill_lets_a_quiet_process_retry() -> None:
    clock = Clock()
    budget = RetryBudget(ratio=0.0, burst=3, min_per_second=0.5, clock=clock)
    assert [budget.try_spend() for _ in range(4)] == [True, True, True, False]
    clock.now += 1.9
    assert not budget.try_spend()
    clock.now += 0.1
    assert budget.try_spend()
    clock.now += 1000
    assert budget.available == 3


def test_invalid_budget_is_rejected() -> None:
    with pytest.raises(ConfigurationError):
        RetryBudget(ratio=-1)
