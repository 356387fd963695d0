"""A PostgreSQL cluster of a test's own, its data and WAL on a small tmpfs the test mounts.

For the database-fault tests (tests/acceptance/test_database_faults.py): filling its disk,
switching it read-only, stopping and starting it must never touch the shared server that
every other test uses. ``initdb`` on a tmpfs takes well under a second; the cluster listens
on 127.0.0.1 on a free port, with trust authentication (nothing secret to leak) and its
log and socket *outside* the volume, so that a full disk leaves the log readable.

Mounting needs root (``mount -t tmpfs``); PostgreSQL refuses to run as root, so its tools
then run as the ``postgres`` user, as ``scripts/services`` does. Whatever is missing fails
with a clear message (:class:`PrivatePostgresFailed`), never a skip.
"""

from __future__ import annotations

import errno
import glob
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg

from tests.support.kafka import free_port
from tests.support.pgbouncer import run_as

USER = "outbox"


class PrivatePostgresFailed(RuntimeError):
    pass


def _bindir() -> Path:
    """Where initdb and pg_ctl are (pg_config's bindir, else the newest Debian layout)."""
    candidates: list[str] = []
    if shutil.which("pg_config"):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True)
        candidates.append(out.stdout.strip())
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for d in candidates:
        if d and os.access(Path(d) / "initdb", os.X_OK):
            return Path(d)
    raise PrivatePostgresFailed(
        "PostgreSQL server binaries (initdb, pg_ctl) not found: apt-get install -y postgresql"
    )


@dataclass
class PrivatePostgres:
    volume: Path  # the tmpfs mount: data directory and WAL
    work: Path  # outside the volume: log, socket
    port: int
    bindir: Path
    run_as: str | None

    @property
    def data(self) -> Path:
        return self.volume / "data"

    @property
    def log(self) -> Path:
        return self.work / "postgres.log"

    @property
    def filler(self) -> Path:
        return self.volume / "filler"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{USER}@127.0.0.1:{self.port}/{database}?sslmode=disable"

    @property
    def libpq(self) -> str:
        # The operator's sessions stay writable whatever default_transaction_read_only says.
        return (
            f"host=127.0.0.1 port={self.port} user={USER} dbname=postgres sslmode=disable "
            "options='-c default_transaction_read_only=off'"
        )

    def _pg(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        command = [str(self.bindir / args[0]), *args[1:]]
        if self.run_as:
            command = ["runuser", "-u", self.run_as, "--", *command]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)

    # -- an operator's moves ------------------------------------------------------------
    def start(self) -> None:
        done = self._pg(
            "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "30", "start"
        )
        if done.returncode != 0:
            raise PrivatePostgresFailed(
                f"pg_ctl start failed ({done.returncode}): {done.stdout}{done.stderr}\n"
                + self.log_tail()
            )

    def running(self) -> bool:
        return self._pg("pg_ctl", "-D", str(self.data), "status").returncode == 0

    def accepts_writes(self) -> bool:
        """True when a write commits (a stopped or full server, or a read-only one: False),
        in a session with the server's defaults (as the daemons' are)."""
        libpq = f"host=127.0.0.1 port={self.port} user={USER} dbname=postgres sslmode=disable"
        try:
            with psycopg.connect(libpq, autocommit=True, connect_timeout=2) as conn:
                conn.execute("CREATE TEMP TABLE probe (x int); INSERT INTO probe VALUES (1)")
            return True
        except psycopg.Error:
            return False

    def stop(self, mode: str = "fast") -> None:
        self._pg("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "30", "stop")

    def fill(self, leave: int = 128 * 1024) -> int:
        """Take all but ``leave`` bytes of the volume with a filler file; its size."""
        # The server writes meanwhile: what was free a moment ago may not be any more.
        for _ in range(50):
            size = max(0, self.free_bytes() - leave)
            try:
                with open(self.filler, "wb") as f:
                    os.posix_fallocate(f.fileno(), 0, size)
                return size
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                leave += 64 * 1024
        raise PrivatePostgresFailed("could not fill the volume (it kept changing)")

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def free_bytes(self) -> int:
        stat = os.statvfs(self.volume)
        return stat.f_bavail * stat.f_frsize

    def sql(self, statement: str) -> None:
        with psycopg.connect(self.libpq, autocommit=True, connect_timeout=5) as conn:
            conn.execute(statement)  # type: ignore[arg-type]

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


@contextmanager
def private_postgres(size_mb: int = 64) -> Iterator[PrivatePostgres]:
    """A started cluster on a ``size_mb`` MiB tmpfs; stopped, unmounted and removed
    afterwards. Its directory is a fresh one under the system's temporary directory, not
    pytest's: the ``postgres`` user must reach it through every parent (pytest's are 0700
    to root)."""
    bindir = _bindir()
    work = Path(tempfile.mkdtemp(prefix="outbox-private-pg-"))
    work.chmod(0o711)
    volume = work / "volume"
    volume.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", str(volume)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        raise PrivatePostgresFailed(
            f"cannot mount a {size_mb} MiB tmpfs on {volume} for the private PostgreSQL "
            f"(needs root: `mount -t tmpfs`): {mounted.stderr.strip() or mounted.returncode}"
        )
    pg: PrivatePostgres | None = None
    try:
        user = run_as("PostgreSQL", PrivatePostgresFailed, volume, work)
        pg = PrivatePostgres(volume, work, free_port(), bindir, user)
        made = pg._pg(
            "initdb", "-D", str(pg.data), "-U", USER, "--auth=trust", "--wal-segsize=1", "-N"
        )
        if made.returncode != 0:
            raise PrivatePostgresFailed(f"initdb failed: {made.stdout}{made.stderr}")
        with open(pg.data / "postgresql.conf", "a") as conf:
            conf.write(
                f"port = {pg.port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{work}'\n"
                # Small and quick: WAL recycled in 1 MiB segments, nothing synced (a tmpfs).
                "max_wal_size = 4MB\nmin_wal_size = 2MB\nfsync = off\n"
                "shared_buffers = 16MB\nmax_connections = 60\n"
            )
        pg.start()
        yield pg
    finally:
        if pg is not None:
            pg.stop("immediate")
        deadline = time.monotonic() + 10
        while subprocess.run(["umount", str(volume)], capture_output=True).returncode != 0:
            if time.monotonic() > deadline:
                raise PrivatePostgresFailed(f"could not unmount {volume}")
            time.sleep(0.2)
        shutil.rmtree(work, ignore_errors=True)
