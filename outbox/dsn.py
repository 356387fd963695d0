"""Database URLs with several hosts, one form for SQLAlchemy and libpq alike.

A URL may name the servers of a failover pair or cluster, for libpq to try in order
(``target_session_attrs=read-write`` keeps only the primary). SQLAlchemy and libpq accept
different spellings of the list, and a raw libpq URI keeps only the last of several
``host`` parameters, so every form is brought to one before either sees it::

    ?host=a,b&port=5432,5433             libpq's own form
    ?host=a:5432&host=b:5433             SQLAlchemy's form
    ?host=a:5432,b:5433                  (neither accepts it as such)

all become ``host=a,b&port=5432,5433`` in :func:`normalized`, which SQLAlchemy's psycopg
dialect passes through and :func:`libpq_conninfo` writes as a key/value string (the form
libpq reads every parameter of, multi-valued ones included). A host without a port gets
an empty entry (libpq's default port).

:func:`server_of` says which server a connection reached: its host and port (not the
URL's first one) and whether it is a primary.
"""

from __future__ import annotations

import re
from typing import Any

from psycopg.conninfo import make_conninfo
from sqlalchemy.engine import URL

# "host:port" in a list entry; a bracketed IPv6 address may carry a port too.
_HOST_PORT = re.compile(r"(\[[^\]]*\]|[^:\[\]]*):(\d*)")


class MultiHostError(ValueError):
    """A database URL whose hosts and ports do not pair up."""


def _split(entry: str) -> tuple[str, str]:
    """("host", "port") of one list entry; a Unix socket path or a bare IPv6 address has
    no port here ("" is libpq's default)."""
    if entry.startswith("/"):
        return entry, ""
    match = _HOST_PORT.fullmatch(entry)
    if match is None:
        return entry, ""
    host, port = match.groups()
    return host.strip("[]"), port


def _values(value: str | tuple[str, ...] | None) -> list[str]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else list(value)
    return [part.strip() for item in items for part in item.split(",")]


def hosts_and_ports(url: URL) -> list[tuple[str, str]]:
    """The (host, port) pairs a URL names, in order (the query's ``host`` list when there
    is one, else the URL's authority); a port may be "" (the default)."""
    query_hosts = _values(url.query.get("host"))
    if not query_hosts:
        return [(url.host or "", str(url.port or ""))]
    pairs = [_split(entry) for entry in query_hosts]
    ports = _values(url.query.get("port"))
    if ports:
        if any(port for _, port in pairs):
            raise MultiHostError("give each host's port once: host=a:p,b:q or port=p,q")
        if len(ports) == 1:
            ports *= len(pairs)
        if len(ports) != len(pairs):
            raise MultiHostError(f"{len(pairs)} hosts but {len(ports)} ports")
        pairs = [(host, port) for (host, _), port in zip(pairs, ports, strict=True)]
    return pairs


def normalized(url: URL) -> URL:
    """``url`` with its host list as ``host=a,b&port=p,q`` (unchanged without one)."""
    if "host" not in url.query:
        return url
    pairs = hosts_and_ports(url)
    query = dict(url.query)
    query["host"] = ",".join(host for host, _ in pairs)
    if any(port for _, port in pairs):
        query["port"] = ",".join(port for _, port in pairs)
    else:
        query.pop("port", None)
    return url.set(host=None, port=None, query=query)


def libpq_conninfo(url: URL) -> str:
    """``url`` as a libpq key/value connection string (every host, every parameter)."""
    url = normalized(url)
    params: dict[str, Any] = {
        "user": url.username,
        "password": url.password,
        "host": url.host,
        "port": url.port,
        "dbname": url.database,
    }
    for key, value in url.query.items():
        params[key] = value if isinstance(value, str) else ",".join(value)
    return make_conninfo("", **{k: v for k, v in params.items() if v not in (None, "")})


def server_of(info: Any) -> str:
    """``host:port (primary|standby)`` of a connection's server (``conn.info``: psycopg's
    ``ConnectionInfo``). A standby says so in the ``in_hot_standby`` parameter it reports
    at login (PostgreSQL 14+)."""
    host = info.host or "localhost"
    role = {"on": "standby", "off": "primary"}.get(
        info.parameter_status("in_hot_standby") or "", "primary or standby unknown"
    )
    where = f"[{host}]" if ":" in host else host
    return f"{where}:{info.port} ({role})"
