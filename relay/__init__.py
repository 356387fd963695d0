"""The relay daemon: moves events to Kafka in order, in batches, crash-safe, from the
outbox table or from the WAL (its sources: relay/sources/).

``Relay(settings).serve()`` runs it; ``relay.failed`` holds the operator functions for
events Kafka rejected permanently. docs/architecture.md maps its rooms.
"""

from relay.daemon import Relay
from relay.failed import FailedRow, list_failed, purge_failed, retry_failed

__all__ = ["FailedRow", "Relay", "list_failed", "purge_failed", "retry_failed"]
