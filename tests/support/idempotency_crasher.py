"""A process that claims an idempotency key, writes its effects, and then hangs inside the
operation until it is SIGKILLed — the crash-mid-operation scenario.

    python -m tests.support.idempotency_crasher DSN SCOPE KEY LOCK_SECONDS BODY_JSON
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from typing import Any

from sqlalchemy.orm import Session

from outbox import Outbox
from outbox.db import sync_engine
from outbox.idempotency import IdempotencyKeys, StoredResponse
from outbox.settings import OutboxSettings
from tests.support.idempotency import write_effect


def main(dsn: str, scope: str, key: str, lock_seconds: float, body: dict[str, Any]) -> None:
    settings = OutboxSettings(database_url=dsn)
    engine = sync_engine(settings)
    keys = IdempotencyKeys(settings)
    outbox = Outbox(settings)

    def operation(session: Session) -> StoredResponse:
        response = write_effect(session, outbox, scope, key, body)
        session.flush()
        print("IN_OPERATION", flush=True)
        time.sleep(3600)  # killed here, effects written but not committed
        return response

    keys.run(
        engine,
        scope=scope,
        key=key,
        payload=body,
        operation=operation,
        lock_timeout=timedelta(seconds=lock_seconds),
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), json.loads(sys.argv[5]))
