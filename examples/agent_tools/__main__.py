"""``python -m examples.agent_tools``: the four-refund incident without the ledger, and with it.

Uses ``OUTBOX_*`` settings for the database (``eval "$(scripts/services env)"``); migrates
on start. The payment provider is a local fake on 127.0.0.1.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from examples.agent_tools.agent import LedgerRefundTool, UnguardedRefundTool
from examples.agent_tools.client import ProviderClient
from examples.agent_tools.incident import replay_incident
from examples.agent_tools.provider import FakeProvider
from outbox import load_settings, migrate
from outbox.db import sync_engine
from outbox.effects import Effects


def main() -> None:
    settings = load_settings()
    migrate.upgrade(settings)
    engine = sync_engine(settings)
    with FakeProvider() as provider, tempfile.TemporaryDirectory() as tmp:
        client = ProviderClient(provider.url)
        without = replay_incident(provider, Path(tmp), UnguardedRefundTool(client))
        print(f"without the ledger: {without.effects} refunds ({without.run.restarts} restarts)")
        tool = LedgerRefundTool(client, Effects(settings), engine)
        with_ = replay_incident(provider, Path(tmp), tool, crash_after_first_tool=True)
        print(f"with the ledger:    {with_.effects} refund ({with_.run.restarts} restart)")
        print(f"agent: {with_.run.answer}")
    engine.dispose()


if __name__ == "__main__":
    main()
