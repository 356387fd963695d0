"""A PostgreSQL primary and a synchronous streaming standby of a test's own.

For the failover tests (tests/acceptance/test_pg_failover.py): the standby is made as an
operator makes one — ``pg_basebackup -R`` with a physical slot of its own on the primary
(``-C -S``) and a ``dbname`` in the ``primary_conninfo`` it writes — and is the one synchronous
standby (``synchronous_standby_names``), so a commit the primary acknowledged is on the
standby too. On PostgreSQL 17+ the pair is set up for failover slots, unless a test leaves
a setting out (``omit``: what ``doctor`` must then name): ``synchronized_standby_slots`` on
the primary; ``sync_replication_slots``, ``hot_standby_feedback`` on the standby.

Both listen on 127.0.0.1 on free ports, with trust authentication (nothing secret to leak),
``fsync = off`` (a test's data). Their directories are fresh ones under the system's
temporary directory: the ``postgres`` user (PostgreSQL refuses to run as root) must reach
them. PostgreSQL 18 comes from the PyPI wheel ``scripts/services`` installs (``pg-bindir``),
15 from the distribution. Whatever is missing fails with :class:`ReplicasFailed`, never a
skip.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import psycopg

from tests.support.kafka import free_port
from tests.support.pgbouncer import run_as

ROOT = Path(__file__).resolve().parents[2]
USER = "outbox"
DATABASE = "outbox"
STANDBY = "standby1"  # its application_name (cluster_name): synchronous_standby_names
STANDBY_SLOT = "standby1_slot"  # its physical slot on the primary (primary_slot_name)


class ReplicasFailed(RuntimeError):
    pass


@cache
def bindir(version: int) -> Path:
    """Where ``version``'s initdb, pg_ctl and pg_basebackup are."""
    if version == 18:
        env = {**os.environ, "OUTBOX_PG_VERSION": "18"}
        found = subprocess.run(
            [str(ROOT / "scripts" / "services"), "pg-bindir"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        if found.returncode != 0:
            raise ReplicasFailed(
                f"PostgreSQL 18 binaries missing (scripts/services pg18-install): {found.stderr}"
            )
        path = Path(found.stdout.strip().splitlines()[-1])
    else:
        matches = glob.glob(f"/usr/lib/postgresql/{version}/bin")
        if not matches:
            raise ReplicasFailed(
                f"PostgreSQL {version} server binaries not found in /usr/lib/postgresql/"
                f"{version}/bin: apt-get install -y postgresql-{version}"
            )
        path = Path(matches[0])
    if not os.access(path / "pg_basebackup", os.X_OK):
        raise ReplicasFailed(f"no pg_basebackup in {path}")
    return path


@dataclass
class Node:
    name: str
    data: Path
    work: Path
    port: int
    bin: Path
    run_as: str | None

    @property
    def log(self) -> Path:
        return self.work / f"{self.name}.log"

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, database: str = DATABASE) -> str:
        return f"postgresql+psycopg://{USER}@127.0.0.1:{self.port}/{database}?sslmode=disable"

    def libpq(self, database: str = DATABASE) -> str:
        return f"host=127.0.0.1 port={self.port} user={USER} dbname={database} sslmode=disable"

    def pg(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        command = [str(self.bin / args[0]), *args[1:]]
        if self.run_as:
            command = ["runuser", "-u", self.run_as, "--", *command]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)

    def checked(self, *args: str, timeout: float = 120) -> str:
        done = self.pg(*args, timeout=timeout)
        if done.returncode != 0:
            raise ReplicasFailed(
                f"{args[0]} ({self.name}) failed ({done.returncode}): {done.stdout}"
                f"{done.stderr}\n{self.log_tail()}"
            )
        return done.stdout

    def configure(self, **settings: str | int) -> None:
        """Append ``settings`` to postgresql.conf (the last line of a name wins)."""
        with open(self.data / "postgresql.conf", "a") as conf:
            for key, value in settings.items():
                shown = value if isinstance(value, int) else "'" + value.replace("'", "''") + "'"
                conf.write(f"{key} = {shown}\n")

    def start(self) -> None:
        self.checked("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "start")

    def stop(self, mode: str = "fast") -> None:
        self.pg("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def promote(self) -> None:
        self.checked("pg_ctl", "-D", str(self.data), "-w", "-t", "60", "promote")

    def query(
        self, statement: str, params: Any = None, database: str = DATABASE
    ) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.libpq(database), autocommit=True, connect_timeout=5) as conn:
            cur = conn.execute(statement, params)  # type: ignore[arg-type]
            return cur.fetchall() if cur.description else []

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


@dataclass
class Pair:
    version: int
    primary: Node
    standby: Node

    def url(self, form: str = "list", database: str = DATABASE) -> str:
        """A URL naming both servers, the primary kept by ``target_session_attrs``:
        ``list`` (``host=a,b&port=p,q``), ``repeated`` (``host=a:p&host=b:q``) or
        ``pairs`` (``host=a:p,b:q``)."""
        p, s = self.primary, self.standby
        hosts = {
            "list": f"host=127.0.0.1,127.0.0.1&port={p.port},{s.port}",
            "repeated": f"host={p.host}&host={s.host}",
            "pairs": f"host={p.host},{s.host}",
        }[form]
        return (
            f"postgresql+psycopg://{USER}@/{database}?{hosts}"
            "&target_session_attrs=read-write&sslmode=disable&connect_timeout=2"
        )

    def wait_streaming(self, within: float = 60) -> None:
        """Until the standby streams from the primary, synchronously."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            rows = self.primary.query(
                "SELECT state, sync_state FROM pg_stat_replication WHERE application_name = %s",
                [STANDBY],
                database="postgres",
            )
            if rows and rows[0] == ("streaming", "sync"):
                return
            time.sleep(0.1)
        raise ReplicasFailed(
            f"the standby does not stream synchronously within {within:g}s\n"
            f"{self.primary.log_tail()}\n{self.standby.log_tail()}"
        )

    def failover(self) -> float:
        """The primary stopped in immediate mode (a crash: nothing flushed or said to
        clients), then the standby promoted; returns the moment of the promotion (Unix
        time, once ``pg_ctl promote`` returned: the new primary accepts writes)."""
        self.primary.stop("immediate")
        self.standby.promote()
        return time.time()

    def dump(self) -> str:
        return (
            f"--- primary log\n{self.primary.log_tail()}\n--- standby log\n"
            f"{self.standby.log_tail()}"
        )


def _node(name: str, work: Path, version: int, user: str | None) -> Node:
    data = work / name
    return Node(name, data, work, free_port(), bindir(version), user)


@contextmanager
def replicated_pair(version: int, omit: frozenset[str] = frozenset()) -> Iterator[Pair]:
    """A started primary and synchronous standby of PostgreSQL ``version`` (15 or 18), the
    database ``outbox`` on both; stopped and removed afterwards. ``omit``: standby-side or
    primary-side failover settings to leave out (``synchronized_standby_slots``,
    ``sync_replication_slots``, ``hot_standby_feedback``, ``primary_slot_name``,
    ``dbname``)."""
    work = Path(tempfile.mkdtemp(prefix=f"outbox-replicas-{version}-"))
    work.chmod(0o711)
    nodes: list[Node] = []
    try:
        user = run_as("PostgreSQL", ReplicasFailed, work)
        primary = _node("primary", work, version, user)
        nodes.append(primary)
        primary.checked("initdb", "-D", str(primary.data), "-U", USER, "--auth=trust", "-N")
        primary.configure(
            port=primary.port,
            listen_addresses="127.0.0.1",
            unix_socket_directories=str(work),
            wal_level="logical",
            max_wal_senders=20,
            max_replication_slots=20,
            max_connections=120,
            shared_buffers="32MB",
            fsync="off",
            wal_keep_size="64MB",
            log_min_messages="warning",
            log_line_prefix="%m [%p] ",
        )
        if version >= 17 and "synchronized_standby_slots" not in omit:
            primary.configure(synchronized_standby_slots=STANDBY_SLOT)
        primary.start()
        primary.query(f"CREATE DATABASE {DATABASE}", database="postgres")
        standby = _node("standby", work, version, user)
        nodes.append(standby)
        slot = [] if "primary_slot_name" in omit else ["-C", "-S", STANDBY_SLOT]
        conninfo = f"host=127.0.0.1 port={primary.port} user={USER}"
        if "dbname" not in omit:
            conninfo += f" dbname={DATABASE}"
        # The standby's directory is made by pg_basebackup (as the postgres user).
        primary.checked(
            "pg_basebackup", "-D", str(standby.data), "-d", conninfo, "-X", "stream", "-R",
            "--checkpoint=fast", *slot,
        )  # fmt: skip
        standby.configure(
            port=standby.port,
            cluster_name=STANDBY,
            # What the primary's settings would make it wait for, once it is one itself.
            synchronous_standby_names="",
            hot_standby="on",
        )
        if version >= 17:
            standby.configure(synchronized_standby_slots="")
            if "sync_replication_slots" not in omit:
                standby.configure(sync_replication_slots="on")
        if "hot_standby_feedback" not in omit:
            standby.configure(hot_standby_feedback="on")
        standby.start()
        # Synchronous once the standby is there (a commit before would wait for it).
        primary.configure(synchronous_standby_names=STANDBY)
        primary.checked("pg_ctl", "-D", str(primary.data), "reload")
        pair = Pair(version, primary, standby)
        pair.wait_streaming()
        yield pair
    finally:
        for node in reversed(nodes):
            if node.data.exists():
                node.stop("immediate")
        shutil.rmtree(work, ignore_errors=True)
