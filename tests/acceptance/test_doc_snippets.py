"""The documentation's runnable code, run as printed against the real services.

The tutorial: its three files are saved as a reader saves them, and its commands run in
its order — ``outbox topics ensure``, ``outbox relay`` and ``outbox consume`` (the console
script itself), two orders placed, one shipped, the other dead-lettered, inspected with
``outbox dlq list``/``show``, fixed and replayed, and a second replay refused. Each command
run here is also checked to be printed on the page.

The testing how-to: its ``pytest.ini``, ``conftest.py`` and ``test_shipping.py`` next to the
tutorial's files, run by pytest in a subprocess (the package's pytest plugin provides the
fixtures). All its tests must pass.

Only the names shared with other test runs change (the topic ``orders``, the group
``shipping``: they live on a shared broker); the tables go to a schema of the test's own
through ``search_path``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, text

from outbox.settings import OutboxSettings
from tests.acceptance.conftest import ROOT, Cli, SchemaFactory
from tests.support.snippets import snippets

pytestmark = pytest.mark.acceptance

TUTORIAL = "docs/tutorial.md"
OUTBOX = str(Path(sys.executable).with_name("outbox"))  # the console script readers run


class Reader:
    """Saves the pages' files into ``home`` and runs what the page says, from there."""

    def __init__(self, home: Path, settings: OutboxSettings, suffix: str) -> None:
        self.home = home
        self.topic, self.group = f"orders-{suffix}", f"shipping-{suffix}"
        # The unqualified table names of the snippets resolve in the test's schema.
        cli = Cli(settings, (("PGOPTIONS", f"-c search_path={settings.db_schema}"),))
        self.env = cli.env
        self.page = (ROOT / TUTORIAL).read_text()
        self.sinks: list[Any] = []

    def save(self, page: str, names: set[str]) -> None:
        found = snippets(page)
        assert names <= set(found), sorted(found)
        for name in names:
            code = found[name]
            for printed, ours in (
                ('topic="orders"', f'topic="{self.topic}"'),
                ('topics=["orders"]', f'topics=["{self.topic}"]'),
                ('name="shipping"', f'name="{self.group}"'),
            ):
                code = code.replace(printed, ours)
            (self.home / name).write_text(code)

    def printed(self, command: str) -> None:
        """``command`` (or its start, before an event id) is on the tutorial page."""
        assert command in self.page, f"the tutorial does not show `{command}`"

    def run(self, *args: str, printed: str | None = None) -> subprocess.CompletedProcess[str]:
        self.printed(printed if printed is not None else " ".join(args))
        argv = [OUTBOX, *args[1:]] if args[0] == "outbox" else [sys.executable, *args[1:]]
        ours = {"orders": self.topic, "shipping": self.group}
        argv = [ours.get(a, a) for a in argv]
        return subprocess.run(
            argv, cwd=self.home, env=self.env, capture_output=True, text=True, timeout=120
        )

    def ok(self, *args: str, printed: str | None = None) -> str:
        proc = self.run(*args, printed=printed)
        assert proc.returncode == 0, f"{' '.join(args)}: {proc.stdout}{proc.stderr}"
        return proc.stdout + proc.stderr

    def daemon(self, *args: str) -> subprocess.Popen[bytes]:
        self.printed(" ".join(args))
        log = (self.home / f"{args[1]}.log").open("wb")
        self.sinks.append(log)
        return subprocess.Popen(
            [OUTBOX, *args[1:]], cwd=self.home, env=self.env, stdout=log, stderr=log
        )

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in self.home.glob("*.log")
        )


def _until(check: Callable[[], Any], what: str, reader: Reader, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}\n{reader.logs()}")


def test_the_tutorial_runs_as_printed(
    fresh_schema: SchemaFactory, acceptance_engine: Engine, tmp_path: Path
) -> None:
    settings = fresh_schema()
    reader = Reader(tmp_path, settings, uuid.uuid4().hex[:8])
    reader.save(TUTORIAL, {"shop_db.py", "place_order.py", "shipping.py"})

    def shipped() -> list[tuple[int, int]]:
        with acceptance_engine.connect() as conn:
            rows = conn.execute(
                text(f"SELECT order_id, grams FROM {settings.db_schema}.shipments ORDER BY 1")
            )
            return [(r[0], r[1]) for r in rows]

    reader.ok("python", "shop_db.py")
    ensured = reader.ok("outbox", "topics", "ensure", "--topic", "orders", "--app", "shipping:app")
    assert f"{reader.topic}.dlq" in ensured, ensured
    daemons = [reader.daemon("outbox", "relay"), reader.daemon("outbox", "consume", "shipping:app")]
    try:
        placed = reader.ok("python", "place_order.py", "1", "book", "2")
        assert re.search(r"order 1 placed: event [0-9a-f-]{36}", placed), placed
        lamp = reader.ok("python", "place_order.py", "2", "lamp", "1")
        event_id = re.findall(r"[0-9a-f-]{36}", lamp)[0]
        _until(lambda: shipped() == [(1, 900)], "order 1 shipped", reader)

        def listed() -> str | None:
            out = reader.ok("outbox", "dlq", "list", "-c", "shipping")
            return out if event_id in out else None

        letters = _until(listed, "the dead letter of order 2", reader)
        assert "Permanent" in letters, letters
        prefix = event_id[:8]  # "the start of the event id ... is enough"
        shown = reader.ok("outbox", "dlq", "show", prefix, printed="outbox dlq show 0a4f")
        assert "unknown product 'lamp'" in shown and "attempts: 1" in shown, shown
        assert shipped() == [(1, 900)]

        reader.ok("python", "shop_db.py", "lamp", "1200")
        reader.ok("outbox", "dlq", "replay", prefix, printed="outbox dlq replay 0a4f")
        _until(lambda: shipped() == [(1, 900), (2, 1200)], "order 2 shipped", reader)
        again = reader.run("outbox", "dlq", "replay", event_id, "-c", "shipping", printed="")
        assert again.returncode == 1 and "already processed" in again.stderr, again.stderr
        assert all(d.poll() is None for d in daemons), reader.logs()
    finally:
        for d in daemons:
            d.terminate()
        for d in daemons:
            d.wait(30)
        for sink in reader.sinks:
            sink.close()
    assert [d.returncode for d in daemons] == [0, 0], reader.logs()


def test_the_testing_howto_passes_as_printed(fresh_schema: SchemaFactory, tmp_path: Path) -> None:
    settings = fresh_schema()
    reader = Reader(tmp_path, settings, uuid.uuid4().hex[:8])
    reader.save(TUTORIAL, {"shop_db.py", "place_order.py", "shipping.py"})
    reader.save("docs/howto/testing.md", {"pytest.ini", "conftest.py", "test_shipping.py"})
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env=reader.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    assert re.search(r"\b3 passed\b", proc.stdout), proc.stdout[-3000:]
