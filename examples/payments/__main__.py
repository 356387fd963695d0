"""Run the payments example: ``python -m examples.payments --port 8000``.

Uses ``OUTBOX_*`` settings (``eval "$(scripts/services env)"``); migrates on start.
``--fault-delay`` makes every refund wait that long before committing (a slow payment
provider), to watch concurrent retries get 409 or to kill the server mid-request.
"""

from __future__ import annotations

import argparse
import asyncio
from datetime import timedelta

import uvicorn

from examples.payments.app import create_app
from outbox import load_settings, migrate


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.payments")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--fault-delay", type=float, default=0.0, help="seconds per refund")
    parser.add_argument("--lock-timeout", type=float, default=None, help="lease in seconds")
    args = parser.parse_args()

    settings = load_settings()
    migrate.upgrade(settings)

    async def slow_provider(refund_id: str) -> None:
        await asyncio.sleep(args.fault_delay)

    app = create_app(
        settings,
        fault=slow_provider if args.fault_delay > 0 else None,
        lock_timeout=timedelta(seconds=args.lock_timeout) if args.lock_timeout else None,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
