"""Resilience toolkit for outbound calls: classification, retry policy, budget, breaker.

Used by the relay and the inbox, and open to users' own calls::

    from outbox.resilience import CircuitBreaker, Retrier, RetryBudget, RetryPolicy

    retrier = Retrier(RetryPolicy(), budget=RetryBudget(), breaker=CircuitBreaker("psp"))
    result = await retrier.call_async(lambda: client.charge(order))

Modules: ``classify`` (retryable or permanent; ``Retry-After``), ``retry`` (backoff with full
jitter), ``budget`` (retries as a share of calls), ``breaker`` (fail fast while a
dependency is down). ``classify`` depends on nothing here; the others build on it.
"""

from outbox.resilience.breaker import BreakerState, CircuitBreaker, CircuitBreakers, CircuitOpen
from outbox.resilience.budget import RetryBudget, RetryBudgetExhausted
from outbox.resilience.classify import (
    HttpStatusError,
    Permanent,
    Retryable,
    is_retryable,
    is_retryable_status,
    retry_after_of,
    retry_after_seconds,
    status_of,
)
from outbox.resilience.retry import Retrier, RetryPolicy

__all__ = [
    "BreakerState",
    "CircuitBreaker",
    "CircuitBreakers",
    "CircuitOpen",
    "HttpStatusError",
    "Permanent",
    "Retrier",
    "RetryBudget",
    "RetryBudgetExhausted",
    "RetryPolicy",
    "Retryable",
    "is_retryable",
    "is_retryable_status",
    "retry_after_of",
    "retry_after_seconds",
    "status_of",
]
