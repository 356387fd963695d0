"""A caller that claims an effect, makes the refund, and is SIGKILLed before it can record
*done* — the crash between the call and the ledger write.

    python -m tests.support.effects_crasher DSN PROVIDER_URL KEY LEASE_SECONDS
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import Any

from examples.agent_tools.client import ProviderClient
from outbox.db import sync_engine
from outbox.effects import Effects
from outbox.settings import OutboxSettings

CHARGE = "ch_crash"
AMOUNT = 500


def main(dsn: str, url: str, key: str, lease_seconds: float) -> None:
    settings = OutboxSettings(database_url=dsn)  # type: ignore[arg-type]
    client = ProviderClient(url)

    def call(k: str) -> Any:
        refund = client.refund(CHARGE, AMOUNT, idempotency_key=k)
        print("CALLED", flush=True)
        time.sleep(3600)  # killed here: the refund exists, the ledger still says pending
        return refund

    Effects(settings).run(
        sync_engine(settings),
        key=key,
        payload={"charge": CHARGE, "amount": AMOUNT},
        call=call,
        lease=timedelta(seconds=lease_seconds),
        dependency="payments",
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]))
