"""Deployment checks behind ``outbox doctor``: each finding says what is wrong and what to do.

Checks: migrations at head (or, for tables your own Alembic history manages, no drift from
the declared tables); every declared index present and valid (the claim index is an
error, the others warnings) and the claim index not bloated; autovacuum storage parameters
on the hot tables; sessions idle in a transaction that hold back the xmin horizon; the
oldest snapshot holding back VACUUM on the outbox (any state: ``pg_dump`` is "active") and
the outbox's dead rows; transactions that wrote the outbox and stay open (the relays' claim
horizon waits for them); dead tuple ratio of the framework's tables; Kafka reachable and
every topic with pending rows (or named by the caller) present with the expected partition
count; consumer groups of more than one member whose members are dynamic (no group
instance id); dead-letter topics that take smaller records than their source topics; relay
heartbeats and lane coverage; clock skew between this host and the database; what each
database URL goes through (PostgreSQL itself, or a pooler in session or transaction mode)
and which components may use it; in WAL mode (or when its slot exists) the WAL source:
``wal_level``, the slot and its ``wal_status``, how much more WAL it may hold back, the
publication, whether a relay reads it (outbox/ops/wal_health.py), and whether the relay's
URL admits the replication connection it streams the slot over, and whether the slot would
survive a failover — a failover slot, ``synchronized_standby_slots``, a standby streaming and
each standby of ``wal.standby_urls`` ready to keep it (outbox/ops/wal_failover.py).

The checks of how relays run (URLs, the source's own checks, heartbeats and lanes) are in
outbox/ops/doctor_relays.py, those of Kafka in outbox/ops/doctor_kafka.py.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict
from datetime import datetime
from typing import Any

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, Index
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.schema import CreateIndex

from outbox import migrate
from outbox.db import translated_errors
from outbox.errors import OutboxError
from outbox.ops.doctor_base import DoctorOptions
from outbox.ops.doctor_kafka import KafkaChecks
from outbox.ops.doctor_relays import RelayChecks
from outbox.ops.findings import Finding, Level
from outbox.ops.vacuum import Holder, redact, vacuum_state
from outbox.settings import OutboxSettings
from outbox.tables import Tables, hot_tables, set_storage_sql, storage_differences

__all__ = ["DoctorOptions", "diagnose", "exit_code", "to_dicts"]

_DIALECT = postgresql.dialect()  # type: ignore[no-untyped-call]
# A claim-index entry (lane smallint + id bigint + tuple header) is ~24 bytes; allow a
# generous factor before calling the index bloated, and ignore small indexes entirely.
_CLAIM_ENTRY_BYTES = 24
_CLAIM_BLOAT_FACTOR = 20
_CLAIM_BLOAT_MIN_BYTES = 64 * 1024 * 1024


def exit_code(findings: list[Finding], strict: bool = False) -> int:
    """1 when any check failed; with ``strict``, 2 when only warnings; else 0."""
    levels = {f.level for f in findings}
    if "error" in levels:
        return 1
    if strict and "warn" in levels:
        return 2
    return 0


def to_dicts(findings: list[Finding]) -> list[dict[str, Any]]:
    return [asdict(f) for f in findings]


def _qualified(tables: Tables, name: str) -> str:
    prep = _DIALECT.identifier_preparer
    return f"{prep.quote_schema(tables.schema or 'public')}.{prep.quote(name)}"


def _difference(diff: Any) -> str:
    """One entry of Alembic's ``compare_metadata``, e.g. ``modify_nullable
    outbox_events.payload`` (a list groups the changes of one column)."""
    first = diff[0] if isinstance(diff, list) else diff
    kind, *args = first
    if kind.startswith("modify_"):
        return f"{kind} {args[1]}.{args[2]}"
    if kind in ("add_column", "remove_column"):
        return f"{kind} {args[1]}.{args[2].name}"
    named = [getattr(a, "name", None) for a in args]
    return f"{kind} {next((n for n in named if n), '')}".strip()


def _create_index_sql(index: Index) -> str:
    ddl = str(CreateIndex(index).compile(dialect=_DIALECT)).strip()
    return ddl.replace("CREATE INDEX ", "CREATE INDEX CONCURRENTLY ", 1) + ";"


def _release_advice(h: Holder) -> str:
    if h.kind == "prepared":
        return f"COMMIT PREPARED or ROLLBACK PREPARED {h.name!r} (see pg_prepared_xacts)"
    if h.kind == "slot":
        return (
            f"let its standby catch up, or drop the slot if nothing uses it: "
            f"SELECT pg_drop_replication_slot({h.name!r});"
        )
    advice = (
        f"let it finish or end it: SELECT pg_terminate_backend({h.pid}); dump a standby "
        "rather than a busy primary; set idle_in_transaction_session_timeout"
    )
    if h.state is None:
        advice += "; grant pg_read_all_stats to see its state, age and query"
    return advice


class _Doctor(RelayChecks, KafkaChecks):
    # -- checks ---------------------------------------------------------------------------
    async def migrations(self, conn: AsyncConnection) -> bool:
        current = await asyncio.to_thread(migrate.current, self.settings)
        head = migrate.head()
        if current is None:
            events = self.tables.events.name
            found = await conn.execute(
                self.store.reloptions, {"schema": self.schema, "names": [events]}
            )
            if found.first() is None:
                self.add(
                    "migrations",
                    "error",
                    f"no outbox tables in schema {self.schema!r}",
                    "run `outbox db upgrade`",
                )
                return False
            await self.own_history(conn)
            return True
        if current != head:
            self.add(
                "migrations",
                "error",
                f"database at revision {current}, this package expects {head}",
                "run `outbox db upgrade` (or upgrade the package if the database is newer)",
                current=current,
                head=head,
            )
        else:
            self.add("migrations", "ok", f"at head revision {head}")
        return True

    async def own_history(self, conn: AsyncConnection) -> None:
        """The tables exist without our version table: the user's own Alembic history
        manages them. Compare them with what this package declares."""
        drift = await conn.run_sync(self._drift)
        if drift:
            more = f"; and {len(drift) - 5} more" if len(drift) > 5 else ""
            shown = "; ".join(drift[:5]) + more
            self.add(
                "migrations",
                "warn",
                f"the outbox tables (managed by your own Alembic history) differ from what this "
                f"version of outbox-inbox declares: {shown}",
                "autogenerate a revision with outbox.build_tables(settings).metadata in "
                "target_metadata and apply it (or use `outbox db upgrade` instead)",
                differences=drift,
            )
        else:
            self.add(
                "migrations",
                "ok",
                "outbox tables managed by your own Alembic history match this version's",
            )

    def _drift(self, conn: Connection) -> list[str]:
        ours = {t.name for t in self.tables.metadata.sorted_tables}
        default = conn.dialect.default_schema_name  # Alembic names it None
        context = MigrationContext.configure(
            conn,
            opts={
                "include_schemas": True,
                "include_name": lambda name, type_, parent: (
                    type_ != "schema" or (name or default) == self.schema
                ),
                "include_object": lambda obj, name, type_, reflected, compare_to: (
                    type_ != "table" or name in ours
                ),
                "compare_server_default": True,
            },
        )
        return [_difference(d) for d in compare_metadata(context, self.tables.metadata)]

    async def indexes(self, conn: AsyncConnection, pending: int) -> None:
        declared = {i.name: i for t in self.tables.metadata.sorted_tables for i in t.indexes}
        claim = f"{self.tables.events.name}_claim_idx"
        rows = await conn.execute(
            self.store.indexes, {"schema": self.schema, "names": list(declared)}
        )
        found = {r.name: r for r in rows}
        problems = False
        for name, index in sorted(declared.items(), key=lambda kv: str(kv[0])):
            level: Level = "error" if name == claim else "warn"
            why = "relays fall back to scanning the whole table" if name == claim else ""
            row = found.get(name)
            qualified = _qualified(self.tables, str(name))
            if row is None:
                problems = True
                self.add(
                    "index",
                    level,
                    f"index {name} is missing" + (f": {why}" if why else ""),
                    f"create it: {_create_index_sql(index)}",
                    index=name,
                )
            elif not (row.valid and row.ready):
                problems = True
                self.add(
                    "index",
                    level,
                    f"index {name} is INVALID (a failed CREATE INDEX CONCURRENTLY?)",
                    f"rebuild it: REINDEX INDEX CONCURRENTLY {qualified};",
                    index=name,
                )
            elif name == claim:
                expected = max(pending, 1) * _CLAIM_ENTRY_BYTES * _CLAIM_BLOAT_FACTOR
                if row.bytes > max(expected, _CLAIM_BLOAT_MIN_BYTES):
                    problems = True
                    self.add(
                        "index",
                        "warn",
                        f"claim index is {row.bytes // 1_048_576} MiB for {pending} pending "
                        "rows (bloated: every claim walks its empty pages)",
                        f"REINDEX INDEX CONCURRENTLY {qualified};",
                        index=name,
                        bytes=int(row.bytes),
                        pending=pending,
                    )
        if not problems:
            self.add("index", "ok", f"{len(declared)} indexes present and valid")

    async def storage(self, conn: AsyncConnection) -> None:
        hot = hot_tables(self.tables)
        rows = await conn.execute(
            self.store.reloptions, {"schema": self.schema, "names": [t.name for t in hot]}
        )
        actual = {r.name: list(r.options) for r in rows}
        for table in hot:
            reloptions = actual.get(table.name, [])
            wrong = storage_differences(table, reloptions)
            if wrong:
                have = dict(option.split("=", 1) for option in reloptions)
                current = ", ".join(f"{k}={have.get(k, 'default')}" for k in wrong)
                self.add(
                    "autovacuum",
                    "warn",
                    f"{table.name}: storage parameters differ from what `outbox db upgrade` "
                    f"sets ({current}): the queue table bloats and claims slow down",
                    f"{set_storage_sql(table, wrong)}; (own Alembic history: see "
                    "outbox.ops.alembic_env.storage_directives)",
                    table=table.name,
                    expected=wrong,
                )
            else:
                self.add("autovacuum", "ok", f"{table.name}: hot-table vacuum settings in place")

    async def idle_transactions(self, conn: AsyncConnection) -> None:
        threshold = self.options.idle_seconds
        rows = list(await conn.execute(self.store.idle_in_transaction, {"threshold": threshold}))
        for r in rows:
            holds = bool(r.holds_horizon)
            self.add(
                "idle_in_transaction",
                "error" if holds else "warn",
                f"session pid {r.pid} ({r.user}@{r.client or 'local'}, "
                f"application {r.application or '-'}) idle in transaction for "
                f"{r.idle_seconds:.0f}s"
                + (
                    f", holding back the xmin horizon ({r.xid_age} xids): VACUUM cannot "
                    "remove dead outbox rows and claim scans slow down"
                    if holds
                    else ""
                ),
                f"end it with SELECT pg_terminate_backend({r.pid}); fix the client that leaves "
                "transactions open and set idle_in_transaction_session_timeout",
                pid=int(r.pid),
                idle_seconds=float(r.idle_seconds),
                holds_horizon=holds,
            )
        if not rows:
            self.add(
                "idle_in_transaction", "ok", f"no session idle in a transaction > {threshold:g}s"
            )

    async def snapshot(self, conn: AsyncConnection) -> None:
        """The oldest transaction, snapshot or slot holding back VACUUM, and what it costs
        the outbox in dead rows."""
        state = await vacuum_state(conn, self.store)
        h, dead = state.holder, state.dead_rows or 0
        limit = self.options.snapshot_seconds
        details: dict[str, Any] = {"outbox_dead_rows": dead, "holder": h and h.to_dict()}
        if h is None or (h.seconds is not None and h.seconds <= limit):
            self.add("snapshot", "ok", f"no snapshot older than {limit:g}s", **details)
            return
        if h.seconds is None and dead < self.options.dead_min_rows:
            # Age hidden from this role, and no sign of harm in the outbox: say nothing.
            self.add("snapshot", "ok", "no sign of a held snapshot", **details)
            return
        level: Level = "error" if dead >= self.options.dead_min_rows else "warn"
        self.add(
            "snapshot",
            level,
            f"{h.describe()} holds back VACUUM; the outbox has {dead} dead row versions "
            "it cannot remove (relays skip them at their lane cursors; the table and its "
            "indexes grow)",
            _release_advice(h),
            **details,
        )

    async def outbox_writers(self, conn: AsyncConnection) -> None:
        """Transactions that wrote the outbox and stay open: the one case relay cursors
        cannot help (claims walk every row published since)."""
        limit = self.options.snapshot_seconds
        table = _qualified(self.tables, self.tables.events.name)
        rows = list(
            await conn.execute(self.store.outbox_writers, {"table": table, "threshold": limit})
        )
        for r in rows:
            self.add(
                "outbox_writer",
                "error",
                f"pid {r.pid} ({r.application or '-'}, {r.state}) wrote the outbox and has "
                f"kept its transaction open for {r.seconds:.0f}s: relays cannot skip the dead "
                f"rows published since (query: {redact(r.query)})",
                f"end it: SELECT pg_terminate_backend({r.pid}); commit right after publish() "
                "in the application",
                pid=int(r.pid),
                seconds=float(r.seconds),
            )
        if not rows:
            self.add("outbox_writer", "ok", f"no outbox writer open for more than {limit:g}s")

    async def dead_tuples(self, conn: AsyncConnection) -> None:
        names = [t.name for t in self.tables.metadata.sorted_tables]
        rows = await conn.execute(self.store.table_stats, {"schema": self.schema, "names": names})
        bloated = False
        for r in rows:
            total = int(r.live) + int(r.dead)
            ratio = int(r.dead) / total if total else 0.0
            if int(r.dead) >= self.options.dead_min_rows and ratio >= self.options.dead_ratio:
                bloated = True
                last = r.last_vacuum.isoformat() if r.last_vacuum else "never"
                self.add(
                    "bloat",
                    "warn",
                    f"{r.name}: {r.dead} dead vs {r.live} live tuples ({ratio:.0%}); last "
                    f"vacuum {last}",
                    f"VACUUM (ANALYZE) {_qualified(self.tables, r.name)}; if it keeps coming "
                    "back, look for sessions holding the xmin horizon and check autovacuum",
                    table=r.name,
                    dead=int(r.dead),
                    live=int(r.live),
                    table_bytes=int(r.table_bytes),
                    index_bytes=int(r.index_bytes),
                )
        if not bloated:
            self.add("bloat", "ok", "dead tuple ratios are fine")

    async def clock(self, conn: AsyncConnection) -> None:
        before = time.time()
        db_now: datetime = (await conn.execute(self.store.clock)).scalar_one()
        after = time.time()
        skew = db_now.timestamp() - (before + after) / 2
        precision = (after - before) / 2
        if abs(skew) - precision > self.options.skew_warn_seconds:
            self.add(
                "clock",
                "warn",
                f"this host's clock is {skew:+.2f}s off the database's",
                "sync both with NTP; ages and retention use the database clock, but logs, "
                "timeouts and anything an application stamps itself will disagree",
                skew_seconds=skew,
            )
        else:
            self.add("clock", "ok", f"clock skew {skew:+.3f}s (±{precision:.3f}s)")

    async def tls(self, conn: AsyncConnection) -> None:
        """Whether the database connection is encrypted (as PostgreSQL sees it)."""
        row = (await conn.execute(self.store.own_tls)).one_or_none()
        url = self.settings.sqlalchemy_url
        sslmode = url.query.get("sslmode", "prefer (libpq default)")
        if row is not None and row.ssl:
            self.add(
                "tls",
                "ok",
                f"database connection uses TLS ({row.version}, sslmode {sslmode})",
                service="database",
                tls=True,
            )
            return
        local = url.host in (None, "", "localhost", "127.0.0.1", "::1")
        self.add(
            "tls",
            "ok" if local else "warn",
            f"database connection is not encrypted (sslmode {sslmode})",
            None if local else "add sslmode=verify-full&sslrootcert=CA.pem to OUTBOX_DATABASE_URL",
            service="database",
            tls=False,
        )


async def diagnose(
    engine: AsyncEngine, settings: OutboxSettings, options: DoctorOptions | None = None
) -> list[Finding]:
    """Run every check; failures to reach a service become findings, not exceptions."""
    doctor = _Doctor(settings, options or DoctorOptions())
    try:
        with translated_errors():
            async with engine.connect() as conn:
                have_tables = await doctor.migrations(conn)
                await doctor.poolers()
                await doctor.clock(conn)
                await doctor.tls(conn)
                await doctor.idle_transactions(conn)
                await doctor.wal(conn)
                await doctor.wal_failover(conn)
                await doctor.wal_stream()
                if have_tables:
                    pending = int((await conn.execute(doctor.store.pending_total)).scalar_one())
                    doctor.wal_switch(pending)
                    await doctor.indexes(conn, pending)
                    await doctor.storage(conn)
                    await doctor.snapshot(conn)
                    await doctor.outbox_writers(conn)
                    await doctor.dead_tuples(conn)
                    await doctor.relays(conn, pending)
                    if doctor.options.kafka:
                        await doctor.topics(conn)
                        await doctor.dead_letter_limits(conn)
    except OutboxError as exc:
        doctor.add("database", "error", str(exc), "check the database and database_url")
    return doctor.findings
