"""Run a program with OpenTelemetry made unimportable, as when the ``otel`` extra is absent.

    python -m tests.support.no_otel REPORT_FILE cli relay ...       # the outbox CLI
    python -m tests.support.no_otel REPORT_FILE publish TOPIC N     # N events, ids printed

At exit the REPORT_FILE gets {"attempted": [...], "imported": [...]}: which opentelemetry
modules something tried to import (and was refused), and which ended up in sys.modules.
"""

from __future__ import annotations

import atexit
import importlib.abc
import json
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType


class _Block(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.attempted: list[str] = []

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            self.attempted.append(name)
            raise ImportError(f"{name} is blocked (the otel extra is not installed)")
        return None


def _report(path: str, block: _Block) -> None:
    imported = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")
    with open(path, "w") as f:
        json.dump({"attempted": block.attempted, "imported": imported}, f)


def publish(topic: str, count: int) -> None:
    from sqlalchemy import create_engine

    from outbox import Outbox, OutboxSettings

    settings = OutboxSettings()
    engine = create_engine(settings.database_url.get_secret_value())
    outbox = Outbox(settings)
    with engine.begin() as conn:
        ids = [
            str(
                outbox.publish(
                    conn, topic=topic, key="k", event_type="order.created", payload={"n": n}
                )
            )
            for n in range(count)
        ]
    engine.dispose()
    print(json.dumps(ids))


def main(argv: list[str]) -> None:
    path, mode, *rest = argv
    block = _Block()
    sys.meta_path.insert(0, block)
    atexit.register(_report, path, block)
    if mode == "publish":
        publish(rest[0], int(rest[1]))
    else:
        from cli.app import main as cli_main

        sys.argv = ["outbox", *rest]
        cli_main()


if __name__ == "__main__":
    main(sys.argv[1:])
