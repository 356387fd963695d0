"""PgBouncer in front of the test PostgreSQL: the Debian package's binary (installed by
scripts/bootstrap), started on a free port in transaction or session mode, with an ini and
an auth file of its own for the URL's user. PgBouncer refuses to run as root: under root it
runs as the ``postgres`` user, which must be able to read its files.

A missing binary is a failure (:class:`PgBouncerFailed`), never a skip.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import make_url

HINT = "run scripts/bootstrap (it installs the Debian package pgbouncer)"
_RUN_AS = "postgres"  # when the tests run as root


class PgBouncerFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class PgBouncer:
    port: int
    mode: str
    pool_size: int
    log_path: Path
    process: subprocess.Popen[bytes]

    def url(self, database_url: str) -> str:
        """``database_url`` (a URL of the PostgreSQL behind it) through this pooler."""
        return (
            make_url(database_url)
            .set(host="127.0.0.1", port=self.port)
            .render_as_string(hide_password=False)
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # PgBouncer: immediate shutdown
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def binary() -> str:
    found = shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.access(p, os.X_OK)), None
    )
    if found is None:
        raise PgBouncerFailed(f"the pgbouncer binary is not installed: {HINT}")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ini(upstream: str, port: int, mode: str, pool_size: int, auth_file: Path) -> str:
    url = make_url(upstream)
    return f"""\
[databases]
* = host={url.host or "127.0.0.1"} port={url.port or 5432}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = scram-sha-256
auth_file = {auth_file}
pool_mode = {mode}
default_pool_size = {pool_size}
max_client_conn = 500
"""


@contextmanager
def pgbouncer(
    upstream: str, mode: str, pool_size: int, *, port: int | None = None
) -> Iterator[PgBouncer]:
    """A PgBouncer in ``mode`` with ``pool_size`` server connections per database and
    user, in front of the PostgreSQL of ``upstream`` (a SQLAlchemy URL, whose user it
    authenticates with SCRAM); stopped on exit."""
    exe = binary()
    url = make_url(upstream)
    port = port or free_port()
    workdir = Path(tempfile.mkdtemp(prefix=f"pgbouncer-{mode}-"))
    try:
        auth_file = workdir / "userlist.txt"
        auth_file.write_text(f'"{url.username}" "{url.password}"\n')
        ini = workdir / "pgbouncer.ini"
        ini.write_text(_ini(upstream, port, mode, pool_size, auth_file))
        user = run_as("PgBouncer", PgBouncerFailed, workdir, auth_file, ini)
        log_path = workdir / "pgbouncer.log"
        with log_path.open("wb") as sink:
            process = subprocess.Popen(
                [exe, str(ini)], stdout=sink, stderr=subprocess.STDOUT, user=user
            )
        pb = PgBouncer(port, mode, pool_size, log_path, process)
        try:
            _wait_listening(pb)
            yield pb
        finally:
            pb.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_as(program: str, error: type[Exception], *paths: Path) -> str | None:
    """The user ``program`` runs as (None: this one), owning ``paths``: under root, the
    ``postgres`` user (PgBouncer and PostgreSQL both refuse root); ``error`` if none."""
    if os.geteuid() != 0:
        return None
    try:
        owner = pwd.getpwnam(_RUN_AS)
    except KeyError:
        raise error(
            f"{program} does not run as root and there is no {_RUN_AS!r} user to run it as"
        ) from None
    for path in paths:
        os.chown(path, owner.pw_uid, owner.pw_gid)
    return _RUN_AS


def _wait_listening(pb: PgBouncer, seconds: float = 15) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if pb.process.poll() is not None:
            raise PgBouncerFailed(f"pgbouncer exited {pb.process.returncode}: {pb.log()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", pb.port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    pb.stop()
    raise PgBouncerFailed(f"pgbouncer not listening on {pb.port} after {seconds}s: {pb.log()}")
