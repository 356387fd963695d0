"""The table source's wake-up: a producer's commit wakes a sleeping relay, and only a
sleeping one.

A relay polls the outbox table (relay/sources/table/pipeline.py); while it sleeps between
polls a new row waits for the end of the sleep: half of ``min_poll_interval_seconds`` on
average amid a stream, up to ``poll_interval_seconds`` after a quiet spell. A NOTIFY per
producer transaction would end every sleep at once, but PostgreSQL serializes the commits
of notifying transactions (a queue lock held through commit), and one per transaction cut
producers' commit throughput by more than half (docs/performance/relay.md). So a producer
notifies only while some relay sleeps, which is exactly when the stream is too light for
that lock to matter:

* a relay about to sleep holds one of ``WAKE_SLOTS`` session advisory locks (exclusive) in
  the wake namespace, taken after a claim that found nothing, in its COMMIT's round trip,
  followed by a look at what became due meanwhile;
* a statement-level trigger on the outbox table (``AFTER INSERT``: whatever inserts, the
  producer helpers, an application's own SQL, ``outbox failed retry``) tries each slot in
  shared mode, transaction-level. All granted: no relay sleeps, nothing else happens (the
  shared locks cost no I/O and go at commit). One refused: ``pg_notify`` on the
  deployment's channel, delivered at commit to every listening relay.

No lost wake-up: a producer transaction that inserted before the slot was taken still
holds its shared lock until it commits, so the relay's exclusive attempt fails while it is
open (the relay then polls as it always did); if it committed before, the look at what is
due (a snapshot taken after the slot) sees its rows, and the relay polls for them. A
producer whose trigger runs after the slot was taken notifies. A notification that
arrives late or for rows already claimed costs one empty claim. Relays without the trigger
(a schema from users' own Alembic history), or more sleeping sessions than slots, fall back
to plain polling.
"""

from __future__ import annotations

import zlib

# Sessions that can sleep with a wake-up at once; a producer tries each. Only the claiming
# pipeline of a light stream sleeps this way (relay/sources/table/claimers.py): one per relay.
WAKE_SLOTS = 4


def namespace_base(schema: str, prefix: str) -> int:
    """What every advisory-lock namespace of one deployment starts from: derived from schema
    and prefix so that two deployments sharing one database never contend."""
    return zlib.crc32(f"{schema}.{prefix}".encode()) & 0x0FFFFFFF


def wake_namespace(schema: str, prefix: str) -> int:
    """The first advisory-lock key of the wake slots (the second is the slot, 0..3)."""
    return namespace_base(schema, prefix) | 0x60000000


def trigger_name(prefix: str) -> str:
    """The trigger's name, and its function's (in the deployment's schema)."""
    return f"{prefix}wake_relay"


def wake_channel(schema: str, prefix: str) -> str:
    """The deployment's NOTIFY channel: short (channel names stop at 63 bytes) and free
    of characters LISTEN would need quoted."""
    return f"outbox_wake_{namespace_base(schema, prefix):07x}"


def trigger_function_sql(function: str, schema: str, prefix: str) -> str:
    """``CREATE FUNCTION`` of the trigger (``function``: its quoted, qualified name)."""
    ns = wake_namespace(schema, prefix)
    slots = " AND ".join(f"pg_try_advisory_xact_lock_shared({ns}, {i})" for i in range(WAKE_SLOTS))
    return (
        f"CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$\n"
        "BEGIN\n"
        "  -- A relay sleeping holds a slot: wake it at commit (outbox/wake.py).\n"
        f"  IF NOT ({slots}) THEN\n"
        f"    PERFORM pg_notify('{wake_channel(schema, prefix)}', '');\n"
        "  END IF;\n"
        "  RETURN NULL;\n"
        "END $$"
    )
