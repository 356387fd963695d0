"""The relay daemon: moves outbox rows to Kafka in order, in batches, crash-safe.

``Relay(settings).serve()`` runs it; ``relay.failed`` holds the operator functions for
rows Kafka rejected permanently.
"""

from relay.daemon import Relay
from relay.failed import FailedRow, list_failed, purge_failed, retry_failed

__all__ = ["FailedRow", "Relay", "list_failed", "purge_failed", "retry_failed"]
