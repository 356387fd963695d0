"""What holds back VACUUM on the outbox, for ``outbox doctor``, ``status`` and ``lag``.

While a transaction holds an old snapshot or xid (``pg_dump``, a report in REPEATABLE
READ, a session idle in transaction, a standby with ``hot_standby_feedback``, a forgotten
prepared transaction, a replication slot), the rows relays delete or mark published stay in
the table and its indexes as dead rows. Relays start their claims at per-lane cursors, so
they keep their speed meanwhile (docs/architecture.md); the table still grows, and a
transaction that *wrote* the outbox and stays open does slow the claims. This module names
the oldest holder: pid, state, age, application name and the first 80 characters of its
query with string literals blanked (``pg_stat_activity`` never shows bind parameters, but a
query sent as plain text carries its values inline).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from outbox.ops.store import OpsStore

# Quoted strings (also cut off by the 80-character limit) and dollar-quoted bodies.
_LITERALS = re.compile(r"'(?:[^']|'')*(?:'|$)|\$([A-Za-z_]\w*|)\$.*?(?:\$\1\$|$)", re.DOTALL)


def redact(query: str | None) -> str | None:
    """``query`` with every string literal replaced by ``'…'``."""
    return None if query is None else _LITERALS.sub("'…'", query)


@dataclass(frozen=True)
class Holder:
    """The oldest transaction, snapshot or slot holding back VACUUM in this database."""

    kind: str  # session | prepared | slot
    pid: int | None
    name: str | None  # application name; the gid of a prepared transaction; the slot's name
    state: str | None  # None when PostgreSQL hides it from this role
    xid_age: int  # transactions since the horizon it holds
    seconds: float | None  # how long it has been open; None when hidden from this role
    query: str | None  # first 80 characters, literals blanked

    def describe(self) -> str:
        age = "age hidden" if self.seconds is None else f"open {self.seconds:.0f}s"
        if self.kind == "prepared":
            return f"prepared transaction {self.name!r} ({age})"
        if self.kind == "slot":
            return f"replication slot {self.name!r} ({self.state}, {self.xid_age} xids behind)"
        state = self.state or "state hidden"
        text = f"pid {self.pid} ({self.name or '-'}, {state}, {age}"
        return text + (f", query: {self.query}" if self.query else "") + ")"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "pid": self.pid,
            "name": self.name,
            "state": self.state,
            "xid_age": self.xid_age,
            "seconds": self.seconds,
            "query": self.query,
        }


@dataclass(frozen=True)
class VacuumState:
    dead_rows: int | None  # the outbox's n_dead_tup (None: no statistics yet)
    holder: Holder | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "outbox_dead_rows": self.dead_rows,
            "oldest_snapshot": self.holder.to_dict() if self.holder else None,
        }


async def vacuum_state(conn: AsyncConnection, store: OpsStore) -> VacuumState:
    events = store.tables.events
    stats = (
        await conn.execute(store.table_stats, {"schema": events.schema, "names": [events.name]})
    ).one_or_none()
    row = (await conn.execute(store.vacuum_holders, {"limit": 1})).one_or_none()
    holder = None
    if row is not None:
        holder = Holder(
            kind=row.kind,
            pid=row.pid,
            name=row.name,
            state=row.state,
            xid_age=int(row.xid_age),
            seconds=None if row.seconds is None else float(row.seconds),
            query=redact(row.query),
        )
    return VacuumState(None if stats is None else int(stats.dead), holder)
