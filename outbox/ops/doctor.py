"""Deployment checks behind ``outbox doctor``: each finding says what is wrong and what to do.

Checks: migrations at head (or, for tables your own Alembic history manages, no drift from
the declared tables); every declared index present and valid (the claim index is an
error, the others warnings) and the claim index not bloated; autovacuum storage parameters
on the hot tables; sessions idle in a transaction that hold back the xmin horizon; the
oldest snapshot holding back VACUUM on the outbox (any state: ``pg_dump`` is "active") and
the outbox's dead rows; transactions that wrote the outbox and stay open (the relays' claim
horizon waits for them); dead tuple ratio of the framework's tables; Kafka reachable and
every topic with pending rows (or named by the caller) present with the expected partition
count; dead-letter topics that take smaller records than their source topics; relay
heartbeats and lane coverage; clock skew between this host and the database; what each
database URL goes through (PostgreSQL itself, or a pooler in session or transaction mode)
and which components may use it; in WAL mode (or when its slot exists) the WAL source:
``wal_level``, the slot and its ``wal_status``, how much more WAL it may hold back, the
publication, whether a relay reads it (outbox/ops/wal_health.py), and whether the relay's
URL admits the replication connection it streams the slot over.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, Index
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.schema import CreateIndex

from outbox import migrate
from outbox.db import describe, replication_connection, translated_errors
from outbox.errors import OutboxError, ReplicationRefused
from outbox.ops.findings import Finding, Level
from outbox.ops.kafka_probe import KafkaProbe
from outbox.ops.lag import default_stale_after
from outbox.ops.record_limits import header_room
from outbox.ops.store import OpsStore
from outbox.ops.vacuum import Holder, redact, vacuum_state
from outbox.ops.wal_health import findings as wal_findings
from outbox.ops.wal_slot import read_state
from outbox.poolers import SessionProbe, probe_session
from outbox.settings import OutboxSettings
from outbox.tables import Tables, build_tables, hot_tables, set_storage_sql, storage_differences

_DIALECT = postgresql.dialect()  # type: ignore[no-untyped-call]
# A claim-index entry (lane smallint + id bigint + tuple header) is ~24 bytes; allow a
# generous factor before calling the index bloated, and ignore small indexes entirely.
_CLAIM_ENTRY_BYTES = 24
_CLAIM_BLOAT_FACTOR = 20
_CLAIM_BLOAT_MIN_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class DoctorOptions:
    topics: Mapping[str, int | None] = field(default_factory=dict)  # name -> partitions
    idle_seconds: float = 60.0
    snapshot_seconds: float = 60.0
    stale_relay_seconds: float | None = None  # default: five relay heartbeat periods
    skew_warn_seconds: float = 1.0
    dead_ratio: float = 0.2
    dead_min_rows: int = 10_000
    kafka: bool = True


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


class _Doctor:
    def __init__(self, settings: OutboxSettings, options: DoctorOptions) -> None:
        self.settings = settings
        self.options = options
        self.tables = build_tables(settings)
        self.store = OpsStore(self.tables)
        self.schema = settings.db_schema
        self.findings: list[Finding] = []

    def add(
        self, check: str, level: Level, what: str, action: str | None = None, **details: Any
    ) -> None:
        self.findings.append(Finding(check, level, what, action, details))

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

    async def poolers(self) -> None:
        """What each configured database URL goes through, and who may use it: anything may
        use a session of its own; behind a transaction pooler producers need
        ``db_pooler=transaction`` (consumers switch by themselves) and the relay refuses."""
        s = self.settings
        probe = await probe_session(s)
        details = _pooler_details("database_url", probe)
        if probe.stable:
            what = f"database_url: {probe.describe()}; every component may use it"
            if s.db_pooler == "transaction":
                what += " (OUTBOX_DB_POOLER=transaction: prepared statements off anyway)"
            self.add("pooler", "ok", what, **details)
        else:
            own_relay_url = s.relay.database_url is not None
            todo = []
            if s.db_pooler != "transaction":
                todo.append(
                    "set OUTBOX_DB_POOLER=transaction wherever this URL is used: psycopg's "
                    "prepared statements fail behind it (consumers turn them off by themselves)"
                )
            if not own_relay_url:
                todo.append(
                    "set OUTBOX_RELAY__DATABASE_URL to a direct or session-pooled URL of the "
                    "same database: the relay refuses this one"
                )
            level: Level = "error" if not own_relay_url else "warn" if todo else "ok"
            relay = "the relay uses relay.database_url" if own_relay_url else "the relay may not"
            what = (
                f"database_url: {probe.describe()}; producers, consumers and operator tools "
                f"may use it, {relay}"
            )
            self.add("pooler", level, what, "; ".join(todo) or None, **details)
        for name, url in (
            ("relay.database_url", s.relay.database_url),
            ("consumer.database_url", s.consumer.database_url),
        ):
            if url is not None:
                await self._daemon_url(name, s.model_copy(update={"database_url": url}))

    async def _daemon_url(self, name: str, settings: OutboxSettings) -> None:
        try:
            probe = await probe_session(settings)
        except OutboxError as exc:
            self.add("pooler", "error", f"{name}: {exc}", f"check {name}", url=name)
            return
        details = _pooler_details(name, probe)
        if name.startswith("relay") and not probe.stable:
            what = f"{name}: {probe.describe()}; the relay refuses it"
            action = "point it at a direct or session-pooled URL of the same database"
            self.add("pooler", "error", what, action, **details)
        else:
            who = "the relay" if name.startswith("relay") else "consumers"
            self.add("pooler", "ok", f"{name}: {probe.describe()}; {who} may use it", **details)

    async def wal(self, conn: AsyncConnection) -> None:
        """The WAL source, in WAL mode or whenever its slot exists (one left over from a
        switch back to the table source holds WAL for nobody)."""
        state = await conn.run_sync(lambda sync: read_state(sync, self.settings))
        if self.settings.source == "wal" or state.slot is not None:
            self.findings += wal_findings(state, self.settings)

    async def wal_stream(self) -> None:
        """In WAL mode, whether the relay's URL admits the replication connection it
        streams the slot over (a pooler in front, or a role without REPLICATION, does not)."""
        if self.settings.source != "wal":
            return
        relay = self.settings.for_relay()
        try:
            conn = await replication_connection(relay, "outbox-doctor")
        except ReplicationRefused as exc:
            action = (
                "point OUTBOX_RELAY__DATABASE_URL at PostgreSQL itself, and grant the relay's "
                "role REPLICATION (`outbox wal setup --print-sql --role ROLE`)"
            )
            self.add("wal_stream", "error", str(exc), action, url=relay.safe_database_url)
            return
        except psycopg.Error as exc:
            what = f"the relay's replication connection could not be opened: {describe(exc)[1]}"
            self.add("wal_stream", "warn", what, url=relay.safe_database_url)
            return
        await conn.close()
        what = "the relay's URL admits the replication connection it streams the slot over"
        self.add("wal_stream", "ok", what, url=relay.safe_database_url)

    def wal_switch(self, pending: int) -> None:
        """In WAL mode, rows left in the outbox table come first: the WAL relay publishes
        nothing from the slot until a table relay has drained them (switching, docs/howto)."""
        if self.settings.source == "wal" and pending:
            self.add(
                "wal_switch",
                "warn",
                f"{pending} events are still pending in the outbox table: the WAL relay "
                "publishes nothing from the slot until they are gone",
                "keep a relay with --source table running until `outbox lag` shows 0 pending",
                pending=pending,
            )

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
            f"{h.describe()} holds back VACUUM; the outbox has {dead} dead rows it cannot "
            "remove (relays skip them at their lane cursors; the table and its indexes grow)",
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

    async def relays(self, conn: AsyncConnection, pending: int) -> None:
        if self.settings.source == "wal" and not pending:
            return  # WAL relays are not lane owners: check wal_reader says whether one reads
        stale_after = self.options.stale_relay_seconds or default_stale_after(self.settings)
        owned: set[int] = set()
        live = 0
        for r in await conn.execute(self.store.relays):
            age = float(r.heartbeat_age)
            if age <= stale_after:
                live += 1
                owned.update(r.lanes or [])
                continue
            self.add(
                "relays",
                "warn",
                f"relay {r.relay_id} ({r.hostname} pid {r.pid}) has not sent a heartbeat for "
                f"{age:.0f}s; it claims lanes {sorted(r.lanes or [])}",
                "if that process is gone, its lanes are free once its database session "
                "ended; delete its row from the relays table (or restart it) to tidy up",
                relay_id=r.relay_id,
                heartbeat_age_seconds=age,
            )
        unowned = [lane for lane in range(self.settings.lanes) if lane not in owned]
        if live == 0:
            self.add(
                "relays",
                "error" if pending else "warn",
                f"no live relay ({pending} events pending)",
                "start one: `outbox relay`",
            )
        elif unowned:
            self.add(
                "relays",
                "warn",
                f"{len(unowned)} of {self.settings.lanes} lanes have no live owner",
                "wait a few seconds for takeover; if it persists, check relay logs",
                unowned=unowned,
            )
        else:
            self.add("relays", "ok", f"{live} live relay(s) own all {self.settings.lanes} lanes")

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

    def kafka_tls(self) -> None:
        """Kafka's protection is what the settings ask for: a client that connected at all
        did so with that protocol (the broker refuses anything else on that listener)."""
        k = self.settings.kafka
        how = k.security_protocol + (f" ({k.sasl_mechanism})" if k.uses_sasl else "")
        self.add(
            "tls",
            "ok",
            f"Kafka connections use {how}" + ("" if k.uses_tls else ": not encrypted"),
            service="kafka",
            tls=k.uses_tls,
        )

    async def topics(self, conn: AsyncConnection) -> None:
        wanted: dict[str, int | None] = {
            t: None for t in (await conn.execute(self.store.pending_topics)).scalars()
        }
        wanted.update(self.options.topics)
        bootstrap = self.settings.kafka_bootstrap_servers
        try:
            async with KafkaProbe(self.settings) as probe:
                counts = await probe.partitions(wanted)
        except OutboxError as exc:
            self.add("kafka", "error", str(exc), "check the broker and kafka_bootstrap_servers")
            return
        self.add("kafka", "ok", f"Kafka at {bootstrap} reachable")
        self.kafka_tls()
        for topic, expected in sorted(wanted.items()):
            have = counts.get(topic)
            if have is None:
                self.add(
                    "topic",
                    "error",
                    f"topic {topic!r} does not exist"
                    + (" but has pending outbox rows" if expected is None else ""),
                    "create it: outbox topics ensure --topic "
                    + (f"{topic}:{expected}" if expected else topic)
                    + " (partitions default to OUTBOX_TOPICS__PARTITIONS, replication to "
                    "OUTBOX_TOPICS__REPLICATION_FACTOR capped by the broker count)",
                    topic=topic,
                )
            elif expected is not None and have != expected:
                self.add(
                    "topic",
                    "warn",
                    f"topic {topic!r} has {have} partitions, expected {expected}",
                    "adding partitions changes which partition a key maps to (per-key order "
                    "breaks across the change); fix the expectation or plan a migration",
                    topic=topic,
                    partitions=have,
                    expected=expected,
                )
            else:
                self.add("topic", "ok", f"topic {topic!r}: {have} partitions", topic=topic)

    async def dead_letter_limits(self, conn: AsyncConnection) -> None:
        """Each existing dead-letter topic of a consumed (or named) topic must take the
        records its source takes: a larger dead letter is kept in the database only."""
        suffix = self.settings.consumer.dlq_suffix
        sources = set((await conn.execute(self.store.consumed_topics)).scalars())
        sources.update(self.options.topics)
        sources = {t for t in sources if not t.endswith(suffix)}
        if not sources:
            return
        try:
            async with KafkaProbe(self.settings) as probe:
                limits = await probe.limits([*sources, *(t + suffix for t in sources)])
        except OutboxError as exc:
            self.add("dead_letter_topic", "warn", f"cannot read topic configs: {exc}")
            return
        room = header_room(self.settings.consumer.error_message_chars)
        pairs = [(t, t + suffix) for t in sorted(sources) if t in limits and t + suffix in limits]
        small = False
        for source, dlq in pairs:
            have, need = limits[dlq].max_message_bytes, limits[source].max_message_bytes
            if have >= need:
                continue
            small = True
            self.add(
                "dead_letter_topic",
                "warn",
                f"dead-letter topic {dlq!r} takes records up to {have} bytes, its source "
                f"{source!r} up to {need}: a larger dead letter is kept in the database only "
                "(a marker without the value goes to the topic)",
                f"kafka-configs.sh --bootstrap-server {self.settings.kafka_bootstrap_servers} "
                f"--alter --entity-type topics --entity-name {dlq} "
                f"--add-config max.message.bytes={need + room}",
                topic=dlq,
                max_message_bytes=have,
                source=source,
                source_max_message_bytes=need,
            )
        if pairs and not small:
            self.add(
                "dead_letter_topic",
                "ok",
                f"{len(pairs)} dead-letter topic(s) take their source topics' records",
            )


def _pooler_details(url: str, probe: SessionProbe) -> dict[str, Any]:
    return {"url": url, "mode": probe.mode, "pooler": probe.pooler, "address": probe.address}


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
