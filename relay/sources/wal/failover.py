"""Telling a failover from any other reconnection of the WAL source (pure, but the one read).

A promotion starts a new timeline. The relay notes the timeline and the slot's confirmed
position each time it looks at the slot (:class:`Seen`); when it looks again on another
timeline, the server it reached is a promoted standby, and the slot there is one of:

* a failover slot synced from the old primary (``synced`` true, PostgreSQL 17+): the relay
  goes on from it. Its confirmed position is at or before what the relay confirmed on the
  old primary, so what came between is published again (the inbox absorbs duplicates);
* missing (not a failover slot, not synced yet, or PostgreSQL before 17), or a slot made
  there since (not synced): it cannot decode what the old primary wrote after the relay's
  last confirmed position. The relay stops with one line naming the failover, that LSN and
  what may be lost (:class:`~relay.errors.SlotLost`, exit 2) — never a silent restart from
  "now".

The same timeline is not a failover: a slot missing then was dropped (relay/sources/wal/slot.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg

from outbox.ops.store import WAL_TIMELINE
from outbox.ops.wal_slot import SlotState
from relay.errors import SlotLost

FIX = (
    "compare what producers committed after that LSN with the topics and publish the "
    "missing events again, then `outbox wal setup` and restart the relay; on PostgreSQL "
    "17+ make the slot a failover slot synced to the standbys so that the next failover "
    "keeps it (docs/operations/postgresql-failover.md)"
)


@dataclass(frozen=True)
class Seen:
    """What the relay last saw of the slot: on which timeline, and its confirmed LSN."""

    timeline: int
    confirmed: str | None


async def timeline(conn: psycopg.AsyncConnection[Any]) -> int | None:
    """The server's current timeline (None on a standby)."""
    row = await (await conn.execute(WAL_TIMELINE)).fetchone()
    return None if row is None or row[0] is None else int(row[0])


def lost_in_failover(
    slot_name: str, before: Seen | None, now: int | None, slot: SlotState | None
) -> SlotLost | None:
    """The error to stop with when the slot did not come through a failover, else None
    (no failover seen, or the slot synced from the old primary)."""
    if before is None or now is None or now == before.timeline:
        return None
    if slot is not None and slot.synced:
        return None
    change = f"a failover (timeline {before.timeline} -> {now})"
    if slot is None:
        what = (
            f"{change}: the new primary has no slot {slot_name} (not a failover slot, or "
            "not synced to this standby before its promotion)"
        )
    else:
        what = (
            f"{change}: slot {slot_name} on the new primary was not synced from the old "
            "one (made there since)"
        )
    return SlotLost(slot_name, before.confirmed, what, advice=FIX)
