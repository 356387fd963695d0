"""Waiting for the WAL source to be drained: switching a deployment back to the table.

Once every producer writes to the outbox table again (``OUTBOX_SOURCE=table``), the events
already in the slot must reach Kafka before any table relay starts: a table relay does not
look at the slot, and would publish a key's newer table rows before its older WAL events.
:func:`wait_drained` notes the WAL position now and waits until the slot's confirmed
position has passed it::

    from outbox.ops.wal_drain import wait_drained

    drain = wait_drained(settings, timeout_seconds=600)
    if drain.drained:
        ...  # start the table relays, stop the WAL relays

Why that is enough: the WAL relay confirms a position only once every event committed
before it is acknowledged by Kafka (or in the failed table), and it confirms at
transaction ends it has read — its own heartbeats included, so an idle slot gets there
within ``wal.heartbeat_seconds``. A confirmed position at or past the one noted here
means every transaction that committed before it was published. Transactions still
writing WAL events when it is noted (a producer not switched yet) are not covered: switch
every producer first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from outbox.db import sync_engine, translated_errors
from outbox.errors import WalSlotUnavailable
from outbox.ops.store import WAL_DRAIN, WAL_NOW
from outbox.settings import OutboxSettings


@dataclass(frozen=True)
class DrainState:
    """Where the slot stands against the position noted at the start."""

    target: str  # the WAL position when the wait began
    confirmed: str | None  # the slot's confirmed position (None: never confirmed)
    behind_bytes: int  # WAL between the two (0 once drained)
    drained: bool
    waited_seconds: float


def wait_drained(
    settings: OutboxSettings,
    timeout_seconds: float,
    progress: Callable[[DrainState], None] | None = None,
    poll_seconds: float = 0.5,
) -> DrainState:
    """Wait until ``settings.wal.slot`` has confirmed everything written to the WAL before
    this call, or ``timeout_seconds`` passed (``drained`` False then). ``progress`` gets
    the state at every poll. :class:`~outbox.errors.WalSlotUnavailable` when the slot is
    missing or lost: what it held cannot be waited for."""
    slot = settings.wal.slot
    engine = sync_engine(settings, pool_pre_ping=False, isolation_level="AUTOCOMMIT")
    started = time.monotonic()
    try:
        with translated_errors(), engine.connect() as conn:
            target = str(conn.execute(WAL_NOW).scalar_one())
            while True:
                row = conn.execute(WAL_DRAIN, {"target": target, "slot": slot}).mappings().first()
                if row is None:
                    raise WalSlotUnavailable(
                        f"replication slot {slot!r} does not exist: nothing to wait for (if it "
                        "held events, they are gone; see docs/operations/wal-slot.md)"
                    )
                if row["wal_status"] == "lost":
                    raise WalSlotUnavailable(
                        f"replication slot {slot!r} is invalidated (wal_status lost): events "
                        f"since LSN {row['confirmed']} may be gone; see docs/operations/wal-slot.md"
                    )
                state = DrainState(
                    target,
                    row["confirmed"],
                    int(row["behind_bytes"] or 0),
                    bool(row["drained"]),
                    time.monotonic() - started,
                )
                if progress is not None:
                    progress(state)
                if state.drained or state.waited_seconds >= timeout_seconds:
                    return state
                time.sleep(poll_seconds)
    finally:
        engine.dispose()
