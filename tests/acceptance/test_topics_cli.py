"""``outbox topics ensure`` as a subprocess against the real broker: creates the relay's and a
consumer app's topics (with their dead-letter topics), is idempotent, reports a topic with
fewer partitions than asked (or not compacted when compaction is asked), creates compacted
topics, and refuses bad specs."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from outbox.ops.kafka_probe import KafkaProbe
from outbox.settings import OutboxSettings
from tests.acceptance.conftest import Cli
from tests.support.kafka import cleanup_policies

pytestmark = pytest.mark.acceptance


def _partitions(settings: OutboxSettings, names: list[str]) -> dict[str, int | None]:
    async def ask() -> dict[str, int | None]:
        async with KafkaProbe(settings) as probe:
            return await probe.partitions(names)

    return asyncio.run(ask())


def test_topics_ensure_creates_then_says_exists(settings: OutboxSettings, tmp_path: Path) -> None:
    suffix = uuid.uuid4().hex[:8]
    relay_topic, consumed = f"ens-relay-{suffix}", f"ens-app-{suffix}"
    module = f"ensure_app_{suffix}"
    (tmp_path / f"{module}.py").write_text(
        f"import inbox\napp = inbox.Consumer(name='g-{suffix}', topics=['{consumed}'])\n"
    )
    cli = Cli(settings, (("PYTHONPATH", str(tmp_path)), ("OUTBOX_TOPICS__PARTITIONS", "2")))
    args = ("topics", "ensure", "--topic", f"{relay_topic}:3", "--app", f"{module}:app")

    first = cli.json(*args)
    assert {r["topic"]: (r["status"], r["partitions"]) for r in first} == {
        relay_topic: ("created", 3),
        consumed: ("created", 2),  # the settings' default
        f"{consumed}.dlq": ("created", 2),  # its source's count
    }
    # One broker here: the default replication factor 3 is capped to 1, not refused.
    assert {r["replication_factor"] for r in first} == {1}
    assert _partitions(settings, [relay_topic, consumed, f"{consumed}.dlq"]) == {
        relay_topic: 3,
        consumed: 2,
        f"{consumed}.dlq": 2,
    }

    second = cli(*args)
    assert second.returncode == 0, second.stderr
    lines = second.stdout.splitlines()
    assert len(lines) == 3 and all(line.startswith("exists") for line in lines), lines

    more = cli("topics", "ensure", "--topic", f"{relay_topic}:5")
    assert more.returncode == 1
    assert "has 3 partitions, 5 asked" in more.stdout
    assert _partitions(settings, [relay_topic]) == {relay_topic: 3}  # left alone


def test_topics_ensure_refuses_bad_input_without_a_traceback(settings: OutboxSettings) -> None:
    cli = Cli(settings)
    for args, code in (
        (("--topic", "orders:x"), 2),
        (("--topic", "bad topic!"), 2),
        (("--app", "no_such_module_xyz:app"), 2),
        ((), 2),
    ):
        proc = cli("topics", "ensure", *args)
        assert proc.returncode == code, (args, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr + proc.stdout


def test_topics_ensure_with_kafka_down_exits_1(settings: OutboxSettings) -> None:
    down = settings.model_copy(update={"kafka_bootstrap_servers": "127.0.0.1:1"})
    proc = Cli(down)("topics", "ensure", "--topic", "anything", timeout=60)
    assert proc.returncode == 1
    assert "BrokerUnavailable" in proc.stderr and "Traceback" not in proc.stderr


def test_topics_ensure_creates_compacted_topics_and_reports_one_that_is_not(
    settings: OutboxSettings,
) -> None:
    suffix = uuid.uuid4().hex[:8]
    compacted, plain = f"ens-state-{suffix}", f"ens-plain-{suffix}"
    cli = Cli(settings, (("OUTBOX_TOPICS__NAMES", f"{plain}:2"),))

    first = cli.json("topics", "ensure", "--topic", f"{compacted}:2:compact")
    assert {r["topic"]: (r["status"], r["compact"]) for r in first} == {
        compacted: ("created", True),
        plain: ("created", False),
    }
    assert _policies(settings, [compacted, plain]) == {compacted: "compact", plain: "delete"}

    again = cli("topics", "ensure", "--topic", f"{compacted}:compact")
    assert again.returncode == 0, again.stderr
    assert f"exists   {compacted} (2 partitions, compacted)" in again.stdout

    # Compaction asked of a topic that deletes by time: reported, left alone, exit 1.
    wrong = cli("topics", "ensure", "--topic", f"{plain}:compact")
    assert wrong.returncode == 1
    assert f"PROBLEM  {plain}: exists with cleanup.policy=delete, compact asked" in wrong.stdout
    assert _policies(settings, [plain]) == {plain: "delete"}


def _policies(settings: OutboxSettings, names: list[str]) -> dict[str, str]:
    return asyncio.run(cleanup_policies(settings.kafka_bootstrap_servers, names))
