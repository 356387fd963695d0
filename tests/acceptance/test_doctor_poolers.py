"""`outbox doctor` behind a real PgBouncer: which pooler each database URL goes through and
which components may use it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.acceptance.conftest import Cli, SchemaFactory
from tests.support.pgbouncer import PgBouncer

pytestmark = pytest.mark.acceptance
Bouncers = Callable[[str, int], PgBouncer]


def poolers(report: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f["details"]["url"]: f for f in report if f["check"] == "pooler"}


def test_doctor_names_a_transaction_pooler_and_the_relay_url_that_fixes_it(
    fresh_schema: SchemaFactory, pgbouncers: Bouncers
) -> None:
    s = fresh_schema()
    direct = s.database_url.get_secret_value()
    pooled = pgbouncers("transaction", 3).url(direct)

    report = Cli(s, (("OUTBOX_DATABASE_URL", pooled),)).json("doctor", "--no-kafka", expect_rc=1)
    finding = poolers(report)["database_url"]
    assert finding["level"] == "error"
    assert finding["details"]["mode"] == "transaction"
    assert finding["details"]["pooler"] == "PgBouncer"
    assert "the relay may not" in finding["what"]
    assert "OUTBOX_RELAY__DATABASE_URL" in finding["action"]
    assert "OUTBOX_DB_POOLER=transaction" in finding["action"]
    assert "outbox:outbox@" not in str(report)

    fixed = Cli(
        s,
        (
            ("OUTBOX_DATABASE_URL", pooled),
            ("OUTBOX_DB_POOLER", "transaction"),
            ("OUTBOX_RELAY__DATABASE_URL", direct),
        ),
    ).json("doctor", "--no-kafka")
    found = poolers(fixed)
    assert found["database_url"]["level"] == "ok"
    assert "the relay uses relay.database_url" in found["database_url"]["what"]
    assert found["relay.database_url"]["level"] == "ok"
    assert found["relay.database_url"]["details"]["mode"] == "none"


def test_doctor_refuses_a_relay_url_through_a_transaction_pooler(
    fresh_schema: SchemaFactory, pgbouncers: Bouncers
) -> None:
    s = fresh_schema()
    pooled = pgbouncers("transaction", 3).url(s.database_url.get_secret_value())
    report = Cli(s, (("OUTBOX_RELAY__DATABASE_URL", pooled),)).json(
        "doctor", "--no-kafka", expect_rc=1
    )
    found = poolers(report)
    assert (
        found["database_url"]["level"] == "ok"
        and found["database_url"]["details"]["mode"] == "none"
    )
    assert found["relay.database_url"]["level"] == "error"
    assert "the relay refuses it" in found["relay.database_url"]["what"]


def test_doctor_lets_every_component_use_a_session_pooler(
    fresh_schema: SchemaFactory, pgbouncers: Bouncers
) -> None:
    s = fresh_schema()
    pooled = pgbouncers("session", 40).url(s.database_url.get_secret_value())
    report = Cli(s, (("OUTBOX_DATABASE_URL", pooled),)).json("doctor", "--no-kafka")
    finding = poolers(report)["database_url"]
    assert finding["level"] == "ok"
    assert (finding["details"]["mode"], finding["details"]["pooler"]) == ("session", "PgBouncer")
    assert "every component may use it" in finding["what"]
