"""What a database URL goes through — PostgreSQL itself, or a pooler (PgBouncer, Supavisor,
RDS Proxy...) in session or in transaction mode — found out by trying, not from the URL.

It matters to two things. psycopg prepares a statement on the server after five runs; behind
a transaction pooler the next transaction of the same client connection may run on another
server session, where it is missing (``db_pooler=transaction`` turns that off, see
:func:`outbox.db.connect_options`). And the relay keeps lane ownership in session advisory
locks: behind a transaction pooler a session is not the client's, two relays could both own
a lane, so the relay refuses to run there (:func:`refusal`).

The probe uses two client connections, A and B, and a session advisory lock on a random key
in a namespace of its own; it takes a few milliseconds:

1. A takes the lock and reads its backend pid. A pooler answers the wire protocol itself, so
   the pid libpq received at login (for cancel requests) is its own invention and differs
   from the backend's: that tells that a pooler is there at all.
2. A asks again in a new transaction: the same backend, still holding the lock? A
   transaction pooler may have moved A to another server session already.
3. Right after, B asks which backends hold the lock. Its own: two client connections share
   one server session — transaction pooling, even with a pool of one server connection,
   where step 2 sees no change. If B gets no server session within ``wait_seconds`` while
   A's next question is answered at once, A keeps its server session while idle and the
   pool is simply full: session pooling.
4. Steps 2 and 3 run three times: other clients' traffic between A's question and B's can
   send B to another server session once, rarely three times in a row.

This is evidence, not proof: a transaction pooler under heavy traffic could pass it. The relay
therefore also checks, at every heartbeat, that its lock connection still answers from the backend
that took its locks (``relay/sources/table/lanes.py``), and ``db_pooler=transaction`` is always
taken at its word.

Behind a transaction pooler A's unlock lands wherever the pooler sends it, so the lock may
stay on a pooled server session until the pooler recycles that connection; its key is
random and its namespace is no one else's.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, LiteralString

import psycopg

from outbox.db import unavailable
from outbox.dsn import server_of
from outbox.errors import DatabaseUnavailable, PoolerUnsupported
from outbox.settings import OutboxSettings, PoolerMode
from outbox.store import PROBE_HOLDERS, PROBE_LOCK, PROBE_UNLOCK

# The probe lock's namespace (first advisory-lock key): the relay's namespaces start with
# 0x1, 0x2 and 0x3 (relay/sources/table/store.py), so this one never meets theirs.
PROBE_NAMESPACE = 0x4F425053
_CONNECT_TIMEOUT = 5  # seconds, libpq's connect_timeout
_ROUNDS = 3
_DOCS = "docs/howto/poolers.md"

AsyncConn = psycopg.AsyncConnection[Any]


class _NoServerSession(DatabaseUnavailable):
    """The pooler gave a client connection no server session in time."""


@dataclass(frozen=True)
class SessionProbe:
    """What the probe saw behind one URL."""

    mode: PoolerMode  # none: PostgreSQL itself; session / transaction: a pooler's mode
    pooler: str | None  # "PgBouncer", "Supavisor", "RDS Proxy", "a connection pooler"
    address: str  # host:port of the server reached, and whether a primary (outbox/dsn.py)
    evidence: str  # what was observed, one clause

    @property
    def stable(self) -> bool:
        """Whether each client connection keeps one server session for its whole life."""
        return self.mode != "transaction"

    def describe(self) -> str:
        if self.pooler is None:
            return f"PostgreSQL itself at {self.address} ({self.evidence})"
        return f"{self.pooler} in {self.mode} mode at {self.address} ({self.evidence})"


async def probe_session(
    settings: OutboxSettings,
    *,
    conn: AsyncConn | None = None,
    wait_seconds: float = 2.0,
) -> SessionProbe:
    """Probe what ``settings.database_url`` goes through (see the module docstring).

    ``conn``: an autocommit connection to that URL to use as A (left open). Raises
    :class:`~outbox.errors.DatabaseRefused` for a refused login, and
    :class:`~outbox.errors.DatabaseUnavailable` when a connection fails or the pooler gives
    no server session within ``wait_seconds``.
    """
    dsn = settings.libpq_dsn
    params = {"ns": PROBE_NAMESPACE, "key": secrets.randbelow(2**31 - 2) + 1}
    a = conn or await _connect(dsn)
    # The server this connection reached: with several hosts in the URL, not its first.
    host, port, address = a.info.host, a.info.port, server_of(a.info)
    try:
        pid, _ = await _ask(a, PROBE_LOCK, params, wait_seconds)
        front = a.info.backend_pid != pid
        b = await _connect(dsn)
        # Unknown until the rounds finish: if they fail, the lock may sit on B's session.
        moved: str | None = "unknown"
        try:
            moved, full = await _rounds(a, b, pid, params, wait_seconds)
        finally:
            if moved is not None:  # the lock may sit on B's server session
                await _unlock_quietly(b, params)
            await b.close()
        await _unlock_quietly(a, params)
    finally:
        if conn is None:
            await a.close()
    if moved is not None:
        name = await _pooler_name(dsn, host, port)
        return SessionProbe("transaction", name, address, moved)
    if not front:
        return SessionProbe("none", None, address, f"backend pid {pid}")
    evidence = "each client connection kept a server session of its own"
    if full:
        evidence += f"; the pool was full (a second connection waited {wait_seconds:g}s)"
    return SessionProbe("session", await _pooler_name(dsn, host, port), address, evidence)


async def _rounds(
    a: AsyncConn, b: AsyncConn, pid: int, params: dict[str, int], wait_seconds: float
) -> tuple[str | None, bool]:
    """Steps 2 to 4, ``_ROUNDS`` times: B asks right after A, when the server session A
    just released is the one a pooler hands out next, unless other traffic came between
    (which is why one round is not enough). Returns (why the session is not stable or
    None, whether the pool was full)."""
    for _ in range(_ROUNDS):
        moved = _moved(pid, *await _ask(a, PROBE_HOLDERS, params, wait_seconds))
        if moved is not None:
            return moved, False
        try:
            pid_b, holders = await _ask(b, PROBE_HOLDERS, params, wait_seconds)
        except _NoServerSession:
            # B waits for a server session. Under session pooling A holds one of its own
            # and answers at once; under a saturated transaction pool A waits too (raises).
            return _moved(pid, *await _ask(a, PROBE_HOLDERS, params, wait_seconds)), True
        if pid_b == pid or pid_b in holders:
            return f"two client connections shared backend {pid_b}", False
    return None, False


def _moved(pid: int, now: int, holders: Sequence[int]) -> str | None:
    """Why A's session is not the one that took the lock, or None if it still is."""
    if now != pid:
        return f"one client connection's transactions ran on backends {pid} and {now}"
    if pid not in holders:
        return f"backend {pid} lost the session lock it took one transaction earlier"
    return None


async def _connect(dsn: str) -> AsyncConn:
    try:
        return await psycopg.AsyncConnection.connect(
            dsn,
            autocommit=True,
            prepare_threshold=None,
            connect_timeout=_CONNECT_TIMEOUT,
            application_name="outbox-session-probe",
        )
    except psycopg.Error as exc:
        raise unavailable(exc) from None


async def _ask(
    conn: AsyncConn, query: LiteralString, params: dict[str, int], wait_seconds: float
) -> tuple[int, Any]:
    task = asyncio.ensure_future(conn.execute(query, params))
    try:
        done, _ = await asyncio.wait({task}, timeout=wait_seconds)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        # Closing fails the waiting query at once; cancelling it would wait for the pooler
        # to pass a cancel request to a server session it does not have.
        await conn.close()
        with contextlib.suppress(psycopg.Error):
            await task
        raise _NoServerSession(
            f"no server session within {wait_seconds:g}s (a connection pooler with every "
            "server connection busy?)"
        )
    try:
        cur = task.result()
    except psycopg.Error as exc:
        raise unavailable(exc) from None
    row = await cur.fetchone()
    assert row is not None
    return int(row[0]), row[1]


async def _unlock_quietly(conn: AsyncConn, params: dict[str, int]) -> None:
    if conn.closed:
        return
    with contextlib.suppress(psycopg.Error, DatabaseUnavailable):
        await _ask(conn, PROBE_UNLOCK, params, 1.0)


async def _pooler_name(dsn: str, host: str | None, port: int | None) -> str:
    """A best guess at which pooler answers: by its managed hostnames and usual ports, and
    PgBouncer by its refusal of the ``options`` startup parameter."""
    host = (host or "").lower()
    if host.endswith(".pooler.supabase.com") or port == 6543:
        return "Supavisor"
    if ".proxy-" in host and host.endswith(".rds.amazonaws.com"):
        return "RDS Proxy"
    if port == 6432 or await _refuses_options(dsn):
        return "PgBouncer"
    return "a connection pooler"


async def _refuses_options(dsn: str) -> bool:
    try:
        conn = await psycopg.AsyncConnection.connect(
            dsn, options="-c outbox.probe=on", connect_timeout=_CONNECT_TIMEOUT
        )
    except psycopg.Error as exc:
        return "unsupported startup parameter" in str(exc)
    await conn.close()
    return False


def refusal(component: str, through: str, why: str, setting: str) -> PoolerUnsupported:
    """The one-line error of a component that needs a session of its own, pointed
    ``through`` a transaction pooler; ``setting`` is where its own URL goes."""
    return PoolerUnsupported(
        f"{component} cannot run through {through}: {why}. Set {setting} to a direct or "
        f"session-pooled URL of the same database (see {_DOCS})"
    )
