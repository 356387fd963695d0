"""Metrics that live in the user's own process (idempotent requests, the effect ledger).

They go to the registry that process already exposes — prometheus-client's default unless
another is given — and are created once per registry, so every front object of the process
counts into the same series (creating them twice would raise "Duplicated timeseries").
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry

T = TypeVar("T")

_lock = threading.Lock()
# Keyed by the registry object itself, held weakly: a key of id(registry) outlives a dropped
# registry, and a new one that reuses its address would get metrics bound to the dead one.
_made: weakref.WeakKeyDictionary[CollectorRegistry, dict[Callable[..., Any], Any]] = (
    weakref.WeakKeyDictionary()
)


def once_per_registry(
    make: Callable[[CollectorRegistry], T], registry: CollectorRegistry | None
) -> T:
    """``make(registry)`` the first time it is asked for ``registry``, the same object after."""
    registry = registry or REGISTRY
    with _lock:
        per_registry = _made.setdefault(registry, {})
        if make not in per_registry:
            per_registry[make] = make(registry)
        made: T = per_registry[make]
        return made
