"""Validation of names that end up in SQL or Kafka.

Schema names and table prefixes are only ever passed to SQLAlchemy as identifiers (which
quotes them); validating them up front turns a typo into a clear error at start-up instead
of a confusing failure deep inside a migration.

Every pattern is matched against the whole string (``fullmatch``): ``$`` would also match
before a final newline, and a topic ending in one passes for valid until Kafka refuses it.
"""

from __future__ import annotations

import re

from outbox.errors import InvalidIdentifier

_SQL_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]*")
_SQL_PREFIX = re.compile(r"(?:[a-z_][a-z0-9_]*)?")
# Kafka's own rule: up to 249 characters of ASCII alphanumerics, '.', '_' and '-'.
_KAFKA_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")
_DOTS = frozenset({".", ".."})
# PostgreSQL truncates identifiers at 63 bytes; leave room for the longest table suffix.
_MAX_PREFIX = 32


def _matches(pattern: re.Pattern[str], value: object) -> bool:
    return isinstance(value, str) and pattern.fullmatch(value) is not None


def sql_identifier(value: str, what: str = "identifier") -> str:
    if not _matches(_SQL_IDENTIFIER, value) or len(value) > 63:
        raise InvalidIdentifier(
            f"{what} {value!r} is not a valid identifier: use lowercase letters, digits and "
            "underscores, starting with a letter or underscore, at most 63 characters"
        )
    return value


def table_prefix(value: str) -> str:
    if not _matches(_SQL_PREFIX, value) or len(value) > _MAX_PREFIX:
        raise InvalidIdentifier(
            f"table prefix {value!r} is not valid: use lowercase letters, digits and "
            f"underscores, at most {_MAX_PREFIX} characters"
        )
    return value


def is_kafka_name(value: object) -> bool:
    """Whether ``value`` is a name Kafka accepts for a topic (or a consumer group)."""
    return (
        isinstance(value, str) and _KAFKA_NAME.fullmatch(value) is not None and value not in _DOTS
    )


def kafka_name(value: str, what: str = "topic") -> str:
    if not is_kafka_name(value):
        raise InvalidIdentifier(kafka_name_problem(value, what))
    return value


def kafka_name_problem(value: object, what: str = "topic") -> str:
    """Why ``value`` is not a valid Kafka name (for the error of the caller's type)."""
    if not isinstance(value, str):
        return f"{what} must be a string, not {type(value).__name__}"
    return (
        f"{what} {value!r:.300} is not a valid Kafka name: 1-249 characters of letters, "
        "digits, '.', '_' and '-' (nothing else, not even a trailing newline)"
    )
