"""The SQLSTATE table (outbox/dberrors.py) and the classifications that read it."""

from __future__ import annotations

import psycopg
import psycopg.errors
import pytest
from sqlalchemy.exc import IntegrityError, InternalError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from inbox.failures import is_infrastructure
from outbox.db import describe, translate
from outbox.dberrors import (
    CONFLICT,
    OUTAGE,
    REFUSED,
    SQLSTATES,
    is_transient,
    sqlstate_trouble,
    trouble,
)
from outbox.effects.classify import EffectClass
from outbox.effects.classify import classify as effect_class
from outbox.errors import DatabaseRefused, DatabaseUnavailable
from outbox.idempotency import IdempotencyKeys
from outbox.settings import OutboxSettings

OUTAGES = ["08000", "08006", "08P01", "25006", "53000", "53100", "53200", "53300", "53400"]
OUTAGES += ["57P01", "57P02", "57P03", "58000", "58030", "58P01"]
CONFLICTS = ["40001", "40P01"]
REFUSALS = ["28000", "28P01", "3D000"]
# The statement's own errors: they keep the caller's rules.
OWN = ["23505", "23503", "22P02", "42601", "42P01", "57014", "55P03", "25P02", "XX000", "57P04"]


@pytest.mark.parametrize(
    ("sqlstate", "kind"),
    [(s, OUTAGE) for s in OUTAGES]
    + [(s, CONFLICT) for s in CONFLICTS]
    + [(s, REFUSED) for s in REFUSALS]
    + [(s, None) for s in OWN],
)
def test_each_sqlstate_has_its_kind(sqlstate: str, kind: object) -> None:
    assert sqlstate_trouble(sqlstate) is kind
    error = psycopg.errors.lookup(sqlstate)("server said no")
    # Raw from the driver (the hot path's statements), or wrapped by SQLAlchemy (a session),
    # whatever class the driver gives it (25006 is an InternalError to psycopg).
    assert trouble(error) is kind
    wrapper = InternalError if isinstance(error, psycopg.InternalError) else OperationalError
    assert trouble(wrapper("INSERT ...", {}, error)) is kind


def test_a_full_code_wins_over_its_class() -> None:
    assert "57P01" in SQLSTATES and "57" not in SQLSTATES
    assert sqlstate_trouble("57014") is None  # a statement timeout is the statement's own
    assert sqlstate_trouble("25006") is OUTAGE and sqlstate_trouble("25P02") is None


def test_failures_without_a_sqlstate() -> None:
    # A connection that failed or was lost before the server answered.
    assert trouble(psycopg.OperationalError("server closed the connection unexpectedly")) is OUTAGE
    assert trouble(psycopg.InterfaceError("the connection is closed")) is OUTAGE
    assert trouble(PoolTimeout("QueuePool limit reached")) is OUTAGE
    assert trouble(DatabaseUnavailable("database unavailable: connection refused")) is OUTAGE
    assert trouble(DatabaseRefused("database configuration error: bad password")) is REFUSED
    # Judged by the SQLSTATE a translated error kept.
    assert trouble(DatabaseUnavailable("x", "53100")) is OUTAGE
    assert trouble(DatabaseUnavailable("x", "40P01")) is CONFLICT
    assert trouble(DatabaseUnavailable("x", "57014")) is None
    # Not database errors at all.
    for other in (RuntimeError("boom"), ValueError("bad"), KeyError("k")):
        assert trouble(other) is None


def test_outages_translate_to_database_unavailable_with_their_cause() -> None:
    readonly = psycopg.errors.ReadOnlySqlTransaction(
        "cannot execute INSERT in a read-only transaction"
    )
    mapped = translate(InternalError("INSERT ...", {}, readonly))
    assert isinstance(mapped, DatabaseUnavailable) and mapped.sqlstate == "25006"
    full = translate(
        OperationalError("INSERT", {}, psycopg.errors.DiskFull("could not extend file"))
    )
    assert isinstance(full, DatabaseUnavailable) and full.sqlstate == "53100"
    assert "SQLSTATE 53100" in str(full)
    # The statement's own errors pass through.
    unique = IntegrityError("INSERT", {}, psycopg.errors.UniqueViolation("duplicate key"))
    assert translate(unique) is unique
    assert describe(psycopg.errors.InvalidPassword("password authentication failed"))[2] is False


def test_daemons_retry_outages_and_conflicts_never_refusals() -> None:
    for code in OUTAGES + CONFLICTS:
        assert is_transient(psycopg.errors.lookup(code)("x")), code
        assert is_infrastructure(psycopg.errors.lookup(code)("x")), code
    for code in REFUSALS:
        assert not is_transient(psycopg.errors.lookup(code)("x")), code
    # As before: the driver's other operational errors are worth another try; the rest not.
    assert is_transient(psycopg.errors.QueryCanceled("statement timeout"))
    assert not is_transient(psycopg.errors.UniqueViolation("duplicate key"))
    assert not is_transient(psycopg.errors.UndefinedColumn("no such column"))


def test_an_effect_the_database_refused_to_do_is_retryable_not_ambiguous() -> None:
    for code in ("53100", "25006", "57P01", "40P01", "40001"):
        error = psycopg.errors.lookup(code)("x")
        assert effect_class(error) is EffectClass.RETRYABLE, code
        assert effect_class(OperationalError("INSERT", {}, error)) is EffectClass.RETRYABLE
    # A connection lost with no answer may have carried a COMMIT: still ambiguous.
    lost = psycopg.OperationalError("server closed the connection unexpectedly")
    assert effect_class(lost) is EffectClass.AMBIGUOUS
    assert effect_class(psycopg.errors.UniqueViolation("dup")) is EffectClass.AMBIGUOUS


def test_an_idempotent_request_never_stores_a_database_outage_as_its_answer() -> None:
    keys = IdempotencyKeys(OutboxSettings(database_url="postgresql://u@h/db"))  # type: ignore[arg-type]
    for code in ("53100", "25006", "40P01", "58030"):
        assert (
            keys.failure_for(OperationalError("INSERT", {}, psycopg.errors.lookup(code)("x")))
            is None
        )
    assert keys.failure_for(ValueError("bad amount")) is not None
