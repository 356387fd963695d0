"""How far behind the WAL source's slot is, in seconds (``outbox lag``, the relay's gauge):
the commit time of the first transaction past the slot's confirmed position, read from a
temporary copy of the slot so that the relay keeps streaming it.

    from outbox.ops.wal_lag import lag_seconds

    probe = lag_seconds(settings)   # LagProbe(seconds=0.4) or LagProbe(None, reason)
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from outbox import pgoutput
from outbox.db import describe, sync_engine, translated_errors
from outbox.errors import WalRecordInvalid
from outbox.ops.store import WAL_PROBE_COPY, WAL_PROBE_DROP, WAL_PROBE_PEEK
from outbox.settings import OutboxSettings

# Rows read from the probe: the first transaction's BEGIN is the first row unless
# non-transactional messages (no BEGIN) come before it.
_PROBE_ROWS = 16


def commit_time(data: bytes) -> datetime | None:
    """The commit time in a pgoutput BEGIN message, None for any other message."""
    if data[:1] != b"B":
        return None
    try:
        return pgoutput.begin(data).moment
    except WalRecordInvalid:
        return None  # not a Begin this code can read: the lag is unknown, not wrong


@dataclass(frozen=True)
class LagProbe:
    """Age of the oldest transaction in the slot the relay has not confirmed: 0.0 when
    there is none (caught up), None with ``reason`` when it could not be measured."""

    seconds: float | None
    reason: str | None = None


def lag_seconds(settings: OutboxSettings, timeout_seconds: float = 10) -> LagProbe:
    """Measure the slot's lag in seconds, on the database clock, over a connection of its
    own.

    PostgreSQL has no "time of an LSN"; the commit time of the first transaction past the
    slot's confirmed position is exact. It is read from a temporary copy of the slot
    (``pg_copy_logical_replication_slot``): peeking the slot itself would take it from the
    relay for the duration. The copy is dropped at once (and by PostgreSQL when the session
    ends in any case). Needs REPLICATION (or superuser); decoding stops after the first
    transaction and is bounded by ``timeout_seconds``. The relay's heartbeat keeps an idle,
    caught-up slot's figure near or below ``wal.heartbeat_seconds``.
    """
    wal = settings.wal
    # Slot names: at most 63 characters of a-z, 0-9 and _.
    probe = f"outbox_lag_probe_{os.getpid()}_{secrets.token_hex(4)}"
    engine = sync_engine(settings, pool_pre_ping=False, poolclass=NullPool)
    try:
        with translated_errors(), engine.connect() as conn:
            try:
                with conn.begin():
                    timeout = int(timeout_seconds * 1000)
                    conn.exec_driver_sql(f"SET LOCAL statement_timeout = {timeout}")
                    conn.execute(WAL_PROBE_COPY, {"slot": wal.slot, "probe": probe})
                    rows = conn.execute(
                        WAL_PROBE_PEEK,
                        {"probe": probe, "n": _PROBE_ROWS, "publication": wal.publication},
                    ).all()
            except DBAPIError as exc:
                if exc.connection_invalidated:
                    raise
                sqlstate, message, _ = describe(exc)
                return LagProbe(None, f"{message} [SQLSTATE {sqlstate}]")
            finally:
                # Creating a slot is not undone by a rollback.
                with conn.begin():
                    conn.execute(WAL_PROBE_DROP, {"probe": probe})
    finally:
        engine.dispose()
    for data, db_now in rows:
        committed = commit_time(bytes(data))
        if committed is not None:
            return LagProbe(max(0.0, (db_now - committed).total_seconds()))
    return LagProbe(0.0)
