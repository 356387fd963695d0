"""``outbox topics ensure``: create the relay's and the consumers' topics (idempotent).

Exit codes: 0 every topic exists or was created; 1 a topic could not be created, exists with
fewer partitions than asked or without the compaction asked, or Kafka could not be reached;
2 bad arguments (a topic spec, an app that cannot be loaded).
"""

from __future__ import annotations

import asyncio

import typer

from cli.consume import load_consumer
from cli.context import out, print_json, run, settings_of, usage
from outbox.ops.topics import TopicResult, TopicSpec, consumer_topics, ensure, relay_topics

app = typer.Typer(help="Kafka topics the deployment needs.", no_args_is_help=True)


@app.command("ensure")
def ensure_command(
    ctx: typer.Context,
    topics: list[str] = typer.Option(
        [],
        "--topic",
        help="A topic the relay publishes to, `NAME[:PARTITIONS][:compact]` (repeatable; added "
        "to OUTBOX_TOPICS__NAMES). ':compact' makes it a compacted topic (cleanup.policy="
        "compact: the latest event per key is kept, a tombstone deletes the key).",
    ),
    apps: list[str] = typer.Option(
        [],
        "--app",
        help="A consumer as MODULE:ATTR: its topics and their dead-letter topics (repeatable).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
) -> None:
    """Create missing topics (partitions from NAME:P or OUTBOX_TOPICS__PARTITIONS; replication
    OUTBOX_TOPICS__REPLICATION_FACTOR capped by the broker count; NAME:compact for
    cleanup.policy=compact). Existing topics are left alone; one with fewer partitions than
    asked, or not compacted when compaction is asked, is reported (exit 1)."""
    settings = settings_of(ctx)

    def wanted() -> list[TopicSpec]:
        specs = relay_topics(settings, topics)
        counts = {s.name: s.partitions for s in specs}
        for target in apps:
            consumer = load_consumer(target)
            specs.extend(consumer_topics(consumer.settings or settings, consumer.topics, counts))
        return specs

    specs = run(wanted)
    if not specs:
        usage(
            "no topics: give --topic NAME[:PARTITIONS] / --app MODULE:ATTR, "
            "or set OUTBOX_TOPICS__NAMES"
        )
    results = run(lambda: asyncio.run(ensure(settings, specs)))
    if as_json:
        print_json([r.to_dict() for r in results])
    else:
        for r in results:
            out.print(_line(r), highlight=False)
    raise typer.Exit(0 if all(r.ok for r in results) else 1)


def _line(r: TopicResult) -> str:
    compacted = ", compacted" if r.compact else ""
    if r.status == "created":
        return (
            f"created  {r.topic} ({r.partitions} partitions, "
            f"replication factor {r.replication_factor}{compacted}"
            f"{', ' + r.detail if r.detail else ''})"
        )
    if r.status == "exists":
        return f"exists   {r.topic} ({r.partitions} partitions{compacted})"
    if r.status in ("too_few_partitions", "not_compacted"):
        return f"PROBLEM  {r.topic}: {r.detail}"
    return f"FAILED   {r.topic}: {r.detail}"
