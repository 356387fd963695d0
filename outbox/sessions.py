"""How a relay's database sessions are named: what the session is for, then the relay
process that opened it (``outbox-relay-lanes 1234@host``).

PostgreSQL shows each session's backend pid, and an operator who kills that kills a
database backend, not the relay; with the relay's own pid and host in every session's
``application_name``, doctor and lag name the process, and a relay can tell which sessions
belong to another relay it takes over from (relay/takeover.py).
"""

from __future__ import annotations

_NAMEDATALEN = 64  # PostgreSQL keeps 63 bytes of an application name


def relay_application(base: str, pid: int, host: str) -> str:
    """The application name of a connection the relay process ``pid`` on ``host`` opens for
    ``base`` (a name without spaces), cut as PostgreSQL keeps it."""
    return f"{base} {pid}@{host}".encode("ascii", "replace")[: _NAMEDATALEN - 1].decode()


def opened_by(application: str, pid: int, host: str) -> bool:
    """Whether the session named ``application`` was opened by relay ``pid`` on ``host``."""
    base, _, rest = application.partition(" ")
    return bool(rest) and application == relay_application(base, pid, host)
