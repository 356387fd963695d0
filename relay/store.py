"""The relay's SQL that every source shares, in one place (the table source's claim SQL is
relay/sources/table/store.py, the WAL source's relay/sources/wal/store.py).

* the relays table: every relay's row (who runs where, which source, which lanes, whether
  it runs the maintenance services), its heartbeat, its leaving;
* the maintenance leader's lock and the maintenance watches' figures;
* the failed table: events moved there (by either source), and the operator commands.

Statements are composed with ``psycopg.sql`` so that the configured schema and table prefix
(validated by the settings) are quoted as identifiers; values are always bind parameters.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from psycopg import sql

from outbox.ops.store import VACUUM_HOLDERS
from outbox.settings import OutboxSettings
from outbox.wake import namespace_base
from relay.event import (
    CE_ID,
    CE_TIME,
    CONTENT_TYPE,
    EVENT_TYPE,
    FINGERPRINT,
    HEADERS,
    ID,
    KEY,
    LANE,
    PAYLOAD,
    QUARANTINE_CONTENT_TYPE,
    SOURCE,
    TOPIC,
    Event,
    payload_bytes,
)

# Payload bytes per statement when events are put back or moved (see RelayStore.restore_chunks).
RESTORE_CHUNK_BYTES = 4 * 1024 * 1024


def namespaces(schema: str, prefix: str) -> tuple[int, int, int]:
    """The table source's advisory-lock namespaces (lane ownership, relay membership, claim
    fence); kept positive so that they compare equal to ``pg_locks.classid`` (an oid). The
    WAL source's reader lock uses ``base | 0x40000000`` and the maintenance leader's
    ``base | 0x50000000``."""
    base = namespace_base(schema, prefix)
    return base | 0x10000000, base | 0x20000000, base | 0x30000000


@dataclass(frozen=True)
class RelayStore:
    schema: str
    prefix: str

    @classmethod
    def of(cls, settings: OutboxSettings) -> RelayStore:
        return cls(settings.db_schema, settings.table_prefix)

    def _table(self, suffix: str) -> sql.Identifier:
        return sql.Identifier(self.schema, f"{self.prefix}{suffix}")

    @cached_property
    def _events(self) -> sql.Identifier:
        return self._table("events")

    @cached_property
    def _failed(self) -> sql.Identifier:
        return self._table("failed")

    @cached_property
    def _relays(self) -> sql.Identifier:
        return self._table("relays")

    @cached_property
    def _events_name(self) -> sql.Literal:
        """The qualified outbox table name as a text literal (for ::regclass)."""
        quoted = ".".join(
            '"' + part.replace('"', '""') + '"' for part in (self.schema, f"{self.prefix}events")
        )
        return sql.Literal(quoted)

    # -- the relays table -------------------------------------------------------------
    @cached_property
    def heartbeat(self) -> sql.Composed:
        """A relay's row, written at every heartbeat (params: relay_id, hostname, pid,
        source, lanes, maintenance)."""
        return sql.SQL(
            "INSERT INTO {relays} (relay_id, hostname, pid, source, lanes, maintenance)"
            " VALUES (%(relay_id)s, %(hostname)s, %(pid)s, %(source)s, %(lanes)s::int2[],"
            " %(maintenance)s)"
            " ON CONFLICT (relay_id) DO UPDATE SET heartbeat_at = now(), lanes = EXCLUDED.lanes,"
            " maintenance = EXCLUDED.maintenance"
        ).format(relays=self._relays)

    @cached_property
    def forget_dead(self) -> sql.Composed:
        """Registry rows of relays silent for %(seconds)s (their locks died with them)."""
        return sql.SQL(
            "DELETE FROM {relays} WHERE heartbeat_at < now() - %(seconds)s * interval '1 second'"
        ).format(relays=self._relays)

    @cached_property
    def any_silent(self) -> sql.Composed:
        """Whether a relay other than %(relay_id)s has been silent for %(seconds)s: a cheap
        look at every heartbeat, before :attr:`silent_sessions` (which costs ~2 ms to plan)."""
        return sql.SQL(
            "SELECT EXISTS (SELECT 1 FROM {relays} WHERE relay_id <> %(relay_id)s"
            " AND heartbeat_at < now() - make_interval(secs => %(seconds)s))"
        ).format(relays=self._relays)

    @cached_property
    def silent_sessions(self) -> sql.Composed:
        """The database sessions of relays silent for %(seconds)s (no heartbeat), other
        than %(relay_id)s, opened before their relay's last heartbeat (a relay restarted
        under the same pid and host opens new ones), each with how long it has been quiet:
        a walsender since its client last replied, any other session since its state last
        changed (NULL: not visible to this role). Matched by the ``pid@host`` in their
        application_name, roughly here and exactly by the caller (relay/takeover.py; names
        are cut at 63 bytes)."""
        return sql.SQL(
            "WITH silent AS (SELECT relay_id, hostname, pid, heartbeat_at,"
            " extract(epoch FROM now() - heartbeat_at)::float8 AS silent_for"
            " FROM {relays} WHERE heartbeat_at < now() - make_interval(secs => %(seconds)s)"
            " AND relay_id <> %(relay_id)s)"
            " SELECT s.relay_id, s.hostname, s.pid, s.silent_for, a.pid, a.application_name,"
            " extract(epoch FROM now() - CASE WHEN a.backend_type = 'walsender'"
            " THEN coalesce(r.reply_time, a.backend_start) ELSE a.state_change END)::float8"
            " FROM silent s"
            " JOIN pg_stat_activity a ON a.datname = current_database()"
            " AND starts_with(a.application_name, 'outbox-relay')"
            " AND strpos(a.application_name, ' ' || s.pid || '@') > 0"
            " LEFT JOIN pg_stat_replication r ON r.pid = a.pid"
            " WHERE a.backend_start IS NULL OR a.backend_start < s.heartbeat_at"
            " ORDER BY s.relay_id, a.pid"
        ).format(relays=self._relays)

    # Params: pid. True when the session was signalled; an error without the privilege.
    end_session = "SELECT pg_terminate_backend(%(pid)s)"

    @cached_property
    def leave(self) -> sql.Composed:
        return sql.SQL("DELETE FROM {relays} WHERE relay_id = %(relay_id)s").format(
            relays=self._relays
        )

    # -- maintenance ------------------------------------------------------------------
    @cached_property
    def lead_maintenance(self) -> sql.Composed:
        """Try the maintenance leader's session lock; true when this session holds it (a
        session holds it until it ends: see relay/maintenance/leader.py)."""
        ns = namespace_base(self.schema, self.prefix) | 0x50000000
        return sql.SQL("SELECT pg_try_advisory_lock({ns}, 0)").format(ns=sql.Literal(ns))

    @cached_property
    def dead_rows(self) -> sql.Composed:
        """Dead row versions of the outbox table (``n_dead_tup``; NULL: no statistics)."""
        return sql.SQL(
            "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = {table}::regclass"
        ).format(table=self._events_name)

    @cached_property
    def oldest_snapshot(self) -> sql.Composed:
        """The oldest transaction or slot holding back VACUUM in this database: (pid, the
        transaction id it holds back from, its age in seconds when visible to this role);
        no row when there is none."""
        return sql.SQL(
            "SELECT h.pid, h.horizon::text, h.seconds FROM ({holders} LIMIT 1) h"
        ).format(holders=sql.SQL(VACUUM_HOLDERS))

    # -- the failed table ---------------------------------------------------------------
    @cached_property
    def move_to_failed(self) -> sql.Composed:
        """Insert events into the failed table (params: :meth:`restore_chunks`)."""
        return sql.SQL(
            "INSERT INTO {failed} (id, event_id, topic, key, lane, event_type, source,"
            " content_type, payload, headers, fingerprint, created_at, attempts, last_error)"
            " SELECT u.id, u.event_id, u.topic, u.key, u.lane, u.event_type, u.source,"
            " u.content_type, u.payload, u.headers, u.fingerprint, u.created_at, u.attempts,"
            " u.err"
            " FROM unnest(%(id)s::int8[], %(event_id)s::uuid[], %(topic)s::text[],"
            " %(key)b::bytea[], %(lane)s::int2[], %(event_type)s::text[], %(source)s::text[],"
            " %(content_type)s::text[], %(payload)b::bytea[], %(headers)s::jsonb[],"
            " %(fingerprint)b::bytea[], %(created_at)s::timestamptz[], %(attempts)s::int4[],"
            " %(err)s::text[])"
            " AS u(id, event_id, topic, key, lane, event_type, source, content_type, payload,"
            " headers, fingerprint, created_at, attempts, err)"
            # The same event may fail again after an operator retried it: keep the latest.
            " ON CONFLICT (event_id) DO UPDATE SET id = EXCLUDED.id, attempts ="
            " EXCLUDED.attempts, last_error = EXCLUDED.last_error, failed_at = now()"
        ).format(failed=self._failed)

    @classmethod
    def restore_chunks(
        cls,
        events: Sequence[Event],
        attempts: Sequence[int],
        errors: Sequence[str | None],
        delays: Sequence[float],
    ) -> Iterator[dict[str, list[Any]]]:
        """The parameters of :attr:`move_to_failed` (and of the table source's put-back) in
        pieces of at most ``RESTORE_CHUNK_BYTES`` of payload (at least one event each), one
        statement each: sending the payloads back costs about twice their size in the client
        while a statement is built (psycopg's dump, libpq's buffer, which keeps its largest
        size for the connection's life), so a claim of large rows goes back a few megabytes
        at a time."""
        start, size = 0, 0
        for i, event in enumerate(events):
            if i > start and size + payload_bytes(event) > RESTORE_CHUNK_BYTES:
                yield cls.restore_params(
                    events[start:i], attempts[start:i], errors[start:i], delays[start:i]
                )
                start, size = i, 0
            size += payload_bytes(event)
        if start < len(events):
            yield cls.restore_params(
                events[start:], attempts[start:], errors[start:], delays[start:]
            )

    @staticmethod
    def restore_params(
        events: Sequence[Event],
        attempts: Sequence[int],
        errors: Sequence[str | None],
        delays: Sequence[float],
    ) -> dict[str, list[Any]]:
        return {
            "id": [e[ID] for e in events],
            "event_id": [e[CE_ID] for e in events],
            "topic": [e[TOPIC] for e in events],
            "key": [e[KEY] for e in events],
            "lane": [e[LANE] for e in events],
            "event_type": [e[EVENT_TYPE] for e in events],
            "source": [e[SOURCE] for e in events],
            "content_type": [e[CONTENT_TYPE] for e in events],
            "payload": [e[PAYLOAD] for e in events],
            "headers": [e[HEADERS] for e in events],
            "fingerprint": [e[FINGERPRINT] for e in events],
            "created_at": [e[CE_TIME] for e in events],
            "delay": list(delays),
            "attempts": list(attempts),
            "err": list(errors),
        }

    @cached_property
    def failed_list(self) -> sql.Composed:
        return sql.SQL(
            "SELECT id, event_id::text, topic, event_type, attempts, last_error, failed_at,"
            " octet_length(payload) FROM {failed}"
            " WHERE (%(topic)s::text IS NULL OR topic = %(topic)s) ORDER BY id LIMIT %(limit)s"
        ).format(failed=self._failed)

    @cached_property
    def failed_count(self) -> sql.Composed:
        return sql.SQL("SELECT count(*) FROM {failed}").format(failed=self._failed)

    @cached_property
    def failed_retry(self) -> sql.Composed:
        """Move failed rows (all when %(ids)s is NULL) back to the outbox, attempts reset.

        They get new ids, in the order of their old ones: they join the head of their lane
        like any new row, so no claim cursor can have passed them (relay/sources/table/cursor.py).
        Returns the failed-table ids that went back. An undecodable WAL message kept there
        (relay/event.py ``QUARANTINE_CONTENT_TYPE``) stays: it is no outbox row, and only the
        WAL source's retry can emit it again.
        """
        return sql.SQL(
            "WITH moved AS (DELETE FROM {failed}"
            " WHERE (%(ids)s::int8[] IS NULL OR id = ANY(%(ids)s::int8[]))"
            " AND content_type IS DISTINCT FROM {quarantined} RETURNING *),"
            " back AS (INSERT INTO {events} (event_id, topic, key, lane, event_type, source,"
            " content_type, payload, headers, fingerprint, created_at)"
            " SELECT event_id, topic, key, lane, event_type, source, content_type, payload,"
            " headers, fingerprint, created_at FROM moved ORDER BY id"
            " ON CONFLICT DO NOTHING RETURNING event_id)"
            " SELECT m.id FROM moved m JOIN back b USING (event_id)"
        ).format(
            failed=self._failed,
            events=self._events,
            quarantined=sql.Literal(QUARANTINE_CONTENT_TYPE),
        )

    @cached_property
    def failed_purge(self) -> sql.Composed:
        """Delete failed rows by id, or older than %(hours)s, or all (both NULL)."""
        return sql.SQL(
            "DELETE FROM {failed} WHERE (%(ids)s::int8[] IS NULL OR id = ANY(%(ids)s::int8[]))"
            " AND (%(hours)s::float8 IS NULL OR failed_at < now() - %(hours)s * interval '1 hour')"
            " RETURNING id"
        ).format(failed=self._failed)
