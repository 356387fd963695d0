"""``outbox lag``, ``outbox doctor``, ``outbox status``, ``outbox cleanup``: operator tools.

Exit codes: 0 fine; 1 a check failed or a service could not be reached (doctor/status:
an error finding; ``lag``: the database, or Kafka when it was asked, did not answer — the
report is still printed, with what Kafka would have said shown as unknown); 2 bad
configuration (refused credentials, unknown database or host), or warnings under
``doctor --strict``; 3 a ``lag`` threshold (``--max-age``/``--max-pending``/
``--max-consumer-lag``) was exceeded, or a consumer lag limit could not be checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import typer
from rich.console import Group
from rich.live import Live
from rich.text import Text

from cli.context import error, notice, out, print_json, print_results, run, settings_of, table
from cli.params import DURATION, duration, renamed
from outbox.db import async_engine
from outbox.errors import ConfigurationError
from outbox.lifecycle import stop_on_signals
from outbox.ops.cleanup import Retention, TargetResult, run_cleanup
from outbox.ops.doctor import DoctorOptions, diagnose, exit_code, to_dicts
from outbox.ops.findings import Finding
from outbox.ops.lag import LagReport, RateTracker, Thresholds, WalLag, collect
from outbox.ops.wal_health import mib
from outbox.settings import OutboxSettings
from outbox.wording import counted

app = typer.Typer()
KAFKA_FAILED = 1
THRESHOLD_EXCEEDED = 3
T = TypeVar("T")


def _with_engine(settings: OutboxSettings, work: Callable[[Any], Awaitable[T]]) -> T:
    async def go() -> T:
        engine = async_engine(settings, pool_size=2, max_overflow=0)
        try:
            return await work(engine)
        finally:
            await engine.dispose()

    return run(lambda: asyncio.run(go()))


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def _lanes(lanes: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts: list[str] = []
    for lane in lanes:
        if parts and lane == int(parts[-1].rsplit("-", 1)[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{lane}"
        else:
            parts.append(str(lane))
    return ",".join(parts) or "-"


# ----------------------------------------------------------------------------------- lag


_STALE_OPTION = typer.Option(
    None,
    "--stale-after",
    parser=duration(0, above=True),
    metavar=DURATION,
    help="A relay without heartbeat for this long is stale [default: 5 heartbeats].",
)


def _render_lag(report: LagReport, breaches: list[str]) -> Group:
    topics = table(title=f"outbox ({report.mode}-mode) at {report.taken_at:%H:%M:%S} db time")
    for name in ("topic", "pending", "due", "oldest", "failed", "rate/s", "partitions"):
        topics.add_column(name, justify="left" if name == "topic" else "right")
    for t in report.topics:
        rate = "-" if t.publish_rate_per_second is None else f"{t.publish_rate_per_second:.1f}"
        parts = "?" if t.exists is None else ("MISSING" if not t.exists else str(t.partitions))
        topics.add_row(
            t.topic,
            str(t.pending),
            str(t.due),
            _age(t.oldest_pending_age_seconds),
            str(t.failed),
            rate,
            parts,
        )
    unowned = f" ({len(report.unowned_lanes)}/{report.lanes} lanes unowned)"
    relays = table(title="relays" + (unowned if report.lanes_needed else ""))
    for name in ("relay", "host", "pid", "source", "heartbeat", "lanes", "state"):
        relays.add_column(name)
    for r in report.relays:
        relays.add_row(
            r.relay_id,
            r.hostname,
            str(r.pid),
            r.source,
            _age(r.heartbeat_age_seconds) + " ago",
            _lanes(r.lanes),
            ("[green]alive[/]" if r.alive else "[red]stale[/]")
            + (", maintenance" if r.maintenance else ""),
        )
    groups = table(title="consumer groups")
    for name in ("group", "topic", "partition", "end", "committed", "lag", "dead letters"):
        groups.add_column(name, justify="left" if name in ("group", "topic") else "right")
    for g in report.groups:
        dead = f"{g.dead_letters} ({g.dead_letters_last_hour} in the last hour)"
        if g.error:
            groups.add_row(g.group, f"[red]{g.error}[/]", "", "", "", "", dead)
        for p in g.partitions:
            committed = "-" if p.committed is None else str(p.committed)
            groups.add_row(
                g.group, p.topic, str(p.partition), str(p.end_offset), committed, str(p.lag), dead
            )
        if not g.measured and not g.error:
            groups.add_row(g.group, "(lag unknown: Kafka not asked)", "", "", "", "?", dead)
        elif not g.partitions and not g.error:
            groups.add_row(g.group, "(no committed offsets)", "", "", "", "0", dead)
    shown: list[Any] = [topics, relays, groups]
    if report.vacuum is not None:
        shown.append(Text(_vacuum_line(report), style="yellow" if _snapshot_held(report) else ""))
    if report.wal is not None:
        shown.append(_wal_line(report.wal))
    if report.kafka_error:
        shown.append(Text(f"kafka: {report.kafka_error}", style="yellow"))
    shown.extend(Text(f"THRESHOLD EXCEEDED: {b}", style="bold red") for b in breaches)
    return Group(*shown)


# A snapshot this old is shown highlighted (the alert rule fires at 10 minutes).
_SNAPSHOT_NOTICE_SECONDS = 60.0


def _relays_line(report: LagReport) -> str:
    """Live and stale relays, each live one with its source and pid, the lanes owned, and
    which relay runs maintenance."""
    stale = len(report.relays) - len(report.live_relays)
    live = ", ".join(f"{r.source} pid {r.pid} on {r.hostname}" for r in report.live_relays)
    line = f"{len(report.live_relays)} live" + (f" ({live})" if live else "") + f", {stale} stale"
    if report.lanes_needed:
        line += f", {report.lanes - len(report.unowned_lanes)}/{report.lanes} lanes owned"
    leader = report.maintenance_relay
    return line + (f"; maintenance on {leader.relay_id}" if leader else "; no maintenance leader")


def _snapshot_held(report: LagReport) -> bool:
    holder = report.vacuum.holder if report.vacuum else None
    return holder is not None and (holder.seconds or 0) > _SNAPSHOT_NOTICE_SECONDS


def _vacuum_line(report: LagReport) -> str:
    """The outbox's dead tuples (row versions VACUUM has yet to remove: not failed rows)
    and what holds back VACUUM, on one line."""
    v = report.vacuum
    if v is None:
        return "vacuum: unknown"
    dead = "unknown" if v.dead_rows is None else str(v.dead_rows)
    held = v.holder.describe() if v.holder else "none"
    return f"vacuum: outbox {dead} dead tuples (not yet vacuumed); oldest snapshot: {held}"


def _wal_line(wal: WalLag, label: str = "wal slot") -> Text:
    """The WAL source's slot on one line, red when it is missing, unreserved or lost."""
    if not wal.exists:
        return Text(f"{label} {wal.slot}: MISSING (`outbox wal setup`)", style="bold red")
    lag = _age(wal.lag_seconds) if wal.lag_seconds is not None else f"? ({wal.lag_unknown})"
    bound = (
        "unbounded (max_slot_wal_keep_size -1)"
        if wal.unbounded
        else f"{mib(wal.safe_wal_size)} more before invalidation"
    )
    reader = f"read by {', '.join(wal.reading)}" if wal.reading else "read by no relay"
    text = (
        f"{label} {wal.slot}: {wal.wal_status}, lag {lag}, retains {mib(wal.retained_bytes)} "
        f"({mib(wal.unconfirmed_bytes)} unconfirmed, confirmed to {wal.confirmed_flush_lsn}); "
        f"{bound}; {reader}, {len(wal.standby_pids)} standing by"
    )
    return Text(text, style="bold red" if wal.wal_status in ("unreserved", "lost") else "")


def _lag_json(report: LagReport, breaches: list[str]) -> str:
    return json.dumps({**report.to_dict(), "breaches": breaches})


@app.command()
def lag(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
    watch: bool = typer.Option(False, "--watch", help="Refresh in place until Ctrl-C."),
    interval: float = typer.Option(
        "2s", "--interval", parser=duration(0.2), metavar=DURATION, help="Between refreshes."
    ),
    max_age: float | None = typer.Option(
        None,
        "--max-age",
        parser=duration(),
        metavar=DURATION,
        help="Exit 3 when the oldest due pending event (WAL source: the oldest transaction "
        "the slot has not confirmed) is older.",
    ),
    max_pending: int | None = typer.Option(
        None, "--max-pending", min=0, help="Exit 3 when more events are pending."
    ),
    max_consumer_lag: int | None = typer.Option(
        None,
        "--max-consumer-lag",
        min=0,
        help="Exit 3 when a consumer group lags by more records.",
    ),
    max_wal_bytes: int | None = typer.Option(
        None,
        "--max-wal-bytes",
        min=0,
        help="WAL source: exit 3 when the slot retains more WAL (bytes).",
    ),
    groups: list[str] = typer.Option([], "--group", help="Consumer group to inspect (repeatable)."),
    discover: bool = typer.Option(
        True, "--discover/--no-discover", help="Also inspect every consumer the inbox knows."
    ),
    topics: list[str] = typer.Option(
        [], "--topic", help="Always show this topic, even with nothing pending (repeatable)."
    ),
    stale_after: float | None = _STALE_OPTION,
    kafka: bool = typer.Option(True, "--kafka/--no-kafka", help="Ask Kafka too."),
    rate_sample: float = typer.Option(
        "1s",
        "--rate-sample",
        parser=duration(),
        metavar=DURATION,
        help="Delete-mode: time between the two Kafka end-offset samples of a one-shot "
        "publish rate (0: no rate).",
    ),
) -> None:
    """Pending events, their age, publish rate, consumer lag, dead letters and relays; with
    the WAL source, its slot's retained WAL and lag in seconds."""
    settings = settings_of(ctx)
    thresholds = Thresholds(max_age, max_pending, max_consumer_lag, max_wal_bytes)
    rates = RateTracker()

    async def snapshot(engine: Any) -> LagReport:
        return await collect(
            engine,
            settings,
            groups=groups,
            discover_groups=discover,
            topics=topics,
            stale_after=stale_after,
            kafka=kafka,
            rates=rates,
            rate_sample_seconds=0 if watch else rate_sample,
        )

    async def once(engine: Any) -> tuple[LagReport, list[str]]:
        report = await snapshot(engine)
        breaches = thresholds.breaches(report)
        if as_json:
            out.print(_lag_json(report, breaches), markup=False, highlight=False, soft_wrap=True)
        else:
            print_results(_render_lag(report, breaches))
        return report, breaches

    async def watching(engine: Any) -> tuple[LagReport | None, list[str]]:
        stop = asyncio.Event()
        breaches: list[str] = []
        report: LagReport | None = None
        # In place on a terminal; elsewhere (a log, CI) one report after the other.
        live = Live(console=out, auto_refresh=False) if out.is_terminal and not as_json else None
        with stop_on_signals(stop.set), live or contextlib.nullcontext():
            while not stop.is_set():
                report = await snapshot(engine)
                breaches = thresholds.breaches(report)
                if as_json:
                    out.print(
                        _lag_json(report, breaches), markup=False, highlight=False, soft_wrap=True
                    )
                elif live is not None:
                    live.update(_render_lag(report, breaches), refresh=True)
                else:
                    print_results(_render_lag(report, breaches))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), interval)
        return report, breaches

    last, breaches = _with_engine(settings, watching if watch else once)
    if last is not None and last.kafka_failed:
        # A probe that asked Kafka and got no answer must not pass as healthy.
        reason = last.kafka_error or "see the consumer groups above"
        error(f"BrokerUnavailable: Kafka did not answer: {reason}")
        raise typer.Exit(KAFKA_FAILED)
    if breaches:
        for b in breaches:
            error(f"ThresholdExceeded: {b}", breach=b)
        raise typer.Exit(THRESHOLD_EXCEEDED)


# -------------------------------------------------------------------------------- doctor

_LEVEL_STYLE = {"ok": "[green]ok[/]", "warn": "[yellow]WARN[/]", "error": "[bold red]ERROR[/]"}


def _parse_topics(specs: list[str]) -> dict[str, int | None]:
    topics: dict[str, int | None] = {}
    for spec in specs:
        name, _, count = spec.partition(":")
        if count and not count.isdigit():
            raise ConfigurationError(f"--topic {spec!r}: expected NAME or NAME:PARTITIONS")
        topics[name] = int(count) if count else None
    return topics


def _doctor_options(
    topics: list[str],
    idle: tuple[float, float | None],
    snapshot: tuple[float, float | None],
    stale_after: float | None,
    kafka: bool,
) -> DoctorOptions:
    """``idle`` and ``snapshot``: the option's duration and its deprecated seconds."""
    idle_seconds = renamed(*idle, old="--idle-seconds", new="--idle-longer-than")
    snapshot_seconds = renamed(*snapshot, old="--snapshot-seconds", new="--snapshot-older-than")
    assert idle_seconds is not None and snapshot_seconds is not None  # both have defaults
    return DoctorOptions(
        topics=run(lambda: _parse_topics(topics)),
        idle_seconds=idle_seconds,
        snapshot_seconds=snapshot_seconds,
        stale_relay_seconds=stale_after,
        kafka=kafka,
    )


def _print_findings(findings: list[Finding], show_ok: bool) -> None:
    shown = table()
    for name in ("level", "check", "finding", "what to do"):
        shown.add_column(name, overflow="fold")
    for f in findings:
        if f.level == "ok" and not show_ok:
            continue
        shown.add_row(_LEVEL_STYLE[f.level], f.check, f.what, f.action or "")
    print_results(shown)


_TOPIC_OPTION = typer.Option(
    [], "--topic", help="Topic that must exist, as NAME or NAME:PARTITIONS (repeatable)."
)
_IDLE_OPTION = typer.Option(
    "60s",
    "--idle-longer-than",
    parser=duration(),
    metavar=DURATION,
    help="Flag sessions idle in a transaction for longer than this.",
)
_SNAPSHOT_OPTION = typer.Option(
    "60s",
    "--snapshot-older-than",
    parser=duration(),
    metavar=DURATION,
    help="Flag a snapshot holding back VACUUM, or an open outbox writer, older than this.",
)
# Deprecated spellings in seconds, still accepted (cli.params.renamed says what to write).
_IDLE_SECONDS = typer.Option(None, "--idle-seconds", min=0, hidden=True)
_SNAPSHOT_SECONDS = typer.Option(None, "--snapshot-seconds", min=0, hidden=True)


@app.command()
def doctor(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Print the findings as JSON."),
    strict: bool = typer.Option(False, "--strict", help="Exit 2 when there are warnings."),
    topics: list[str] = _TOPIC_OPTION,
    idle_longer_than: float = _IDLE_OPTION,
    snapshot_older_than: float = _SNAPSHOT_OPTION,
    stale_after: float | None = _STALE_OPTION,
    kafka: bool = typer.Option(True, "--kafka/--no-kafka", help="Check Kafka topics too."),
    idle_seconds: float | None = _IDLE_SECONDS,
    snapshot_seconds: float | None = _SNAPSHOT_SECONDS,
) -> None:
    """Check a deployment; every finding says what to do. Exit 1 on errors."""
    settings = settings_of(ctx)
    options = _doctor_options(
        topics,
        (idle_longer_than, idle_seconds),
        (snapshot_older_than, snapshot_seconds),
        stale_after,
        kafka,
    )
    findings = _with_engine(settings, lambda engine: diagnose(engine, settings, options))
    if as_json:
        print_json(to_dicts(findings))
    else:
        _print_findings(findings, show_ok=True)
    raise typer.Exit(exit_code(findings, strict))


@app.command()
def status(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    topics: list[str] = _TOPIC_OPTION,
    idle_longer_than: float = _IDLE_OPTION,
    snapshot_older_than: float = _SNAPSHOT_OPTION,
    stale_after: float | None = _STALE_OPTION,
    idle_seconds: float | None = _IDLE_SECONDS,
    snapshot_seconds: float | None = _SNAPSHOT_SECONDS,
) -> None:
    """A short summary: backlog, relays, consumers, and the doctor's problems."""
    settings = settings_of(ctx)
    options = _doctor_options(
        topics,
        (idle_longer_than, idle_seconds),
        (snapshot_older_than, snapshot_seconds),
        stale_after,
        kafka=True,
    )

    async def both(engine: Any) -> tuple[LagReport, list[Finding]]:
        report = await collect(engine, settings, topics=topics, stale_after=stale_after)
        return report, await diagnose(engine, settings, options)

    report, findings = _with_engine(settings, both)
    code = exit_code(findings)
    if as_json:
        totals = report.to_dict()["totals"]
        problems = [f for f in to_dicts(findings) if f["level"] != "ok"]
        groups = {
            g.group: {"lag": g.total_lag, "dead_letters": g.dead_letters} for g in report.groups
        }
        relays = [
            {k: r[k] for k in ("relay_id", "hostname", "pid", "source", "alive", "maintenance")}
            for r in report.to_dict()["relays"]
        ]
        data = {
            "totals": totals,
            "relays": relays,
            "groups": groups,
            "vacuum": report.to_dict()["vacuum"],
            "wal": report.to_dict()["wal"],
            "problems": problems,
            "exit_code": code,
        }
        print_json(data)
        raise typer.Exit(code)
    out.print(
        f"database {settings.safe_database_url} schema {settings.db_schema} ({report.mode}-mode)\n"
        f"outbox   {report.pending} pending, oldest {_age(report.oldest_pending_age_seconds)}, "
        f"{report.failed} failed\n"
        f"relays   {_relays_line(report)}\n"
        f"{_vacuum_line(report).replace('vacuum: ', 'vacuum   ', 1)}",
        highlight=False,
    )
    if report.wal is not None:
        out.print(_wal_line(report.wal, label="wal      slot"), highlight=False)
    for g in report.groups:
        out.print(
            f"consumer {g.group}: lag {'unknown' if g.total_lag is None else g.total_lag}, "
            f"{counted(g.dead_letters, 'dead letter')}" + (f" ({g.error})" if g.error else ""),
            highlight=False,
        )
    counts = {level: sum(f.level == level for f in findings) for level in ("ok", "warn", "error")}
    out.print(
        f"doctor   {counts['ok']} ok, {counted(counts['warn'], 'warning')}, "
        f"{counted(counts['error'], 'error')}",
        highlight=False,
    )
    if counts["warn"] or counts["error"]:
        _print_findings(findings, show_ok=False)
    raise typer.Exit(code)


# ------------------------------------------------------------------------------- cleanup


@app.command()
def cleanup(
    ctx: typer.Context,
    dry_run: bool = typer.Option(False, "--dry-run", help="Only count what would be deleted."),
    as_json: bool = typer.Option(False, "--json", help="Print the totals as JSON."),
    batch_size: int = typer.Option(1000, "--batch-size", min=1, max=100_000),
    published_older_than: float | None = typer.Option(
        None,
        "--published-older-than",
        parser=duration(),
        metavar=DURATION,
        help="Published outbox rows to delete (default: relay.keep_published_hours; "
        "nothing in delete-mode).",
    ),
    inbox_older_than: float | None = typer.Option(
        None,
        "--inbox-older-than",
        parser=duration(),
        metavar=DURATION,
        help="Inbox rows to delete (default: consumer.dedupe_window_days).",
    ),
    failed_older_than: float | None = typer.Option(
        None,
        "--failed-older-than",
        parser=duration(),
        metavar=DURATION,
        help="Also delete failed rows this old (e.g. 30d).",
    ),
    idempotency: bool = typer.Option(
        True, "--idempotency/--no-idempotency", help="Purge expired idempotency records."
    ),
    effects: bool = typer.Option(
        True,
        "--effects/--no-effects",
        help="Purge effect-ledger records (done/failed) past their dedupe window.",
    ),
    pause: float = typer.Option(
        "0s", "--pause", parser=duration(), metavar=DURATION, help="Sleep between batches."
    ),
) -> None:
    """Delete rows past retention in short, bounded batches that never lock a table."""
    settings = settings_of(ctx)
    default = Retention.from_settings(settings)
    retention = Retention(
        published_seconds=default.published_seconds
        if published_older_than is None
        else published_older_than,
        inbox_seconds=default.inbox_seconds if inbox_older_than is None else inbox_older_than,
        failed_seconds=failed_older_than,
        idempotency=idempotency,
        effects=effects,
    )

    def progress(result: TargetResult) -> None:
        if not as_json and result.batches % 10 == 1:
            notice(
                f"  {result.target}: {result.deleted} deleted "
                f"({counted(result.batches, 'batch', 'batches')})",
                target=result.target,
                deleted=result.deleted,
            )

    report = _with_engine(
        settings,
        lambda engine: run_cleanup(
            engine,
            settings,
            retention,
            batch_size=batch_size,
            dry_run=dry_run,
            pause_seconds=pause,
            progress=progress,
        ),
    )
    if as_json:
        print_json(report.to_dict())
        return
    verb = "would delete" if dry_run else "deleted"
    for r in report.results:
        cutoff = f"older than {r.cutoff:%Y-%m-%d %H:%M:%S%z}" if r.cutoff else "expired"
        out.print(f"{r.target:12} {verb} {r.deleted} ({cutoff})", highlight=False)
    out.print(f"total        {verb} {report.total} in {report.seconds:.1f}s", highlight=False)
