"""Validation of names that end up in SQL or Kafka.

Schema names and table prefixes are only ever passed to SQLAlchemy as identifiers (which
quotes them); validating them up front turns a typo into a clear error at start-up instead
of a confusing failure deep inside a migration.
"""

from __future__ import annotations

import re

from outbox.errors import InvalidIdentifier

_SQL_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]*$")
_SQL_PREFIX = re.compile(r"^[a-z_][a-z0-9_]*$|^$")
# Kafka's own rule: up to 249 characters of ASCII alphanumerics, '.', '_' and '-'.
_KAFKA_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
# PostgreSQL truncates identifiers at 63 bytes; leave room for the longest table suffix.
_MAX_PREFIX = 32


def sql_identifier(value: str, what: str = "identifier") -> str:
    if len(value) > 63 or not _SQL_IDENTIFIER.match(value):
        raise InvalidIdentifier(
            f"{what} {value!r} is not a valid identifier: use lowercase letters, digits and "
            "underscores, starting with a letter or underscore, at most 63 characters"
        )
    return value


def table_prefix(value: str) -> str:
    if len(value) > _MAX_PREFIX or not _SQL_PREFIX.match(value):
        raise InvalidIdentifier(
            f"table prefix {value!r} is not valid: use lowercase letters, digits and "
            f"underscores, at most {_MAX_PREFIX} characters"
        )
    return value


def kafka_name(value: str, what: str = "topic") -> str:
    if not _KAFKA_NAME.match(value) or value in {".", ".."}:
        raise InvalidIdentifier(
            f"{what} {value!r} is not a valid Kafka name: 1-249 characters of letters, "
            "digits, '.', '_' and '-'"
        )
    return value
