"""The job roles' script (`outbox db sql --roles`): quoted identifiers for the configured
schema and prefix, validated role names, and each job's grants (the real refusals are
proven against PostgreSQL in tests/security/test_roles.py)."""

from __future__ import annotations

import re

import pytest

from outbox.errors import InvalidIdentifier
from outbox.roles import JOBS, role_names, roles_sql
from outbox.settings import OutboxSettings


def grants(script: str, role: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("GRANT") and role in line]


def test_every_identifier_is_quoted_and_follows_schema_and_prefix() -> None:
    script = roles_sql(OutboxSettings(db_schema="billing", table_prefix="ob_"))
    assert '"billing"."ob_events"' in script and '"ob_relay"' in script
    for line in script.splitlines():
        if line.startswith("GRANT"):
            on = line.split(" ON ", 1)[1].split(" TO ")[0]
            for name in re.split(r",\s*", on.removeprefix("SCHEMA ")):
                assert name.startswith('"') and name.endswith('"'), line


def test_a_role_prefix_of_its_own_is_validated() -> None:
    assert role_names("billing_") == {job: f"billing_{job}" for job in JOBS}
    with pytest.raises(InvalidIdentifier):
        roles_sql(OutboxSettings(), role_prefix='x"; DROP ROLE postgres; --')


def test_the_producer_may_only_insert_into_the_outbox() -> None:
    script = roles_sql(OutboxSettings())
    on_events = [g for g in grants(script, '"outbox_producer"') if '"outbox_events"' in g]
    assert on_events == [
        'GRANT INSERT ON "public"."outbox_events" TO "outbox_producer";',
        'GRANT SELECT ("event_id", "fingerprint", "topic", "key", "event_type", '
        '"content_type", "payload") ON "public"."outbox_events" TO "outbox_producer";',
    ]


def test_the_consumer_gets_nothing_on_the_outbox_and_the_script_is_idempotent() -> None:
    script = roles_sql(OutboxSettings())
    consumer = grants(script, '"outbox_consumer"')
    assert consumer and not [g for g in consumer if "outbox_events" in g and "USAGE" not in g]
    assert script.count("EXCEPTION WHEN duplicate_object") == len(JOBS)
