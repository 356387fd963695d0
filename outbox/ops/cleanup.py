"""Retention: delete what is past its keep time, in bounded batches (``outbox cleanup``).

Targets:

* ``events`` - published outbox rows older than ``relay.keep_published_hours`` (keep-mode
  only; in delete-mode the relay deletes rows as soon as Kafka acknowledged them);
* ``inbox`` - inbox rows processed longer ago than ``consumer.dedupe_window_days`` (a
  redelivery older than that window is no longer recognised as a duplicate - that is what
  the window means);
* ``idempotency`` - expired idempotency records (``IdempotencyKeys.purge_expired_async``);
* ``effects`` - side-effect ledger records (``done``/``failed``) whose dedupe window has
  passed; ``pending`` and ``unknown`` records are never deleted;
* ``failed`` - rows Kafka rejected, only when the caller names an age explicitly.

Each batch is one short transaction deleting at most ``batch_size`` rows that could be
locked without waiting (``FOR UPDATE SKIP LOCKED``), so a cleanup never blocks a relay, a
consumer or a producer, and never holds a snapshot long enough to hold back VACUUM. Cutoffs
are computed once per run on the database clock.

:func:`run_cleanup` is the library entry point; a daemon can call it periodically as a
maintenance task.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Literal

from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.db import translated_errors
from outbox.idempotency.keys import IdempotencyKeys
from outbox.ops.store import OpsStore
from outbox.settings import OutboxSettings
from outbox.tables import Tables, build_tables

Target = Literal["events", "inbox", "idempotency", "effects", "failed"]
# ids are bigint identity values; start the key walk below any id a user could insert.
BEFORE_ALL_IDS = -(2**63)


@dataclass(frozen=True)
class Retention:
    """How long each kind of row is kept, in seconds; None leaves that table alone."""

    published_seconds: float | None
    inbox_seconds: float | None
    failed_seconds: float | None = None
    idempotency: bool = True
    effects: bool = True

    @classmethod
    def from_settings(cls, settings: OutboxSettings) -> Retention:
        keep = settings.relay.keep_published_hours
        return cls(
            published_seconds=keep * 3600 if keep > 0 else None,
            inbox_seconds=settings.consumer.dedupe_window_days * 86400,
        )


@dataclass
class TargetResult:
    target: Target
    cutoff: datetime | None  # None for idempotency/effects (each record has its own expiry)
    deleted: int = 0  # with dry_run: rows that would be deleted
    batches: int = 0


@dataclass
class CleanupReport:
    dry_run: bool
    results: list[TargetResult] = field(default_factory=list)
    seconds: float = 0.0
    # Where the next call's walk of published outbox rows may start (``events_after``);
    # None unless ``events_horizon`` was given.
    events_resume_after: int | None = None

    @property
    def total(self) -> int:
        return sum(r.deleted for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        del data["events_resume_after"]  # for a maintenance loop, not for people
        for r in data["results"]:
            r["cutoff"] = r["cutoff"].isoformat() if r["cutoff"] else None
        data["total"] = self.total
        return data


Progress = Callable[[TargetResult], None]


class Cleaner:
    """The deletes of each target, in bounded batches (what :func:`run_cleanup` runs, and
    what the relay's retention services run a few batches of at a time)."""

    def __init__(
        self,
        engine: AsyncEngine,
        tables: Tables,
        idempotency: IdempotencyKeys,
        *,
        batch_size: int = 1000,
        pause_seconds: float = 0.0,
        max_batches: int | None = None,
        progress: Progress | None = None,
    ) -> None:
        self.engine = engine
        self.store = OpsStore(tables)
        self.idempotency = idempotency
        self.batch_size = batch_size
        self.pause = pause_seconds
        self.max_batches = max_batches
        self.progress = progress or (lambda _r: None)

    async def _scalar(self, stmt: Any, params: dict[str, Any]) -> Any:
        with translated_errors():
            async with self.engine.connect() as conn:
                return (await conn.execute(stmt, params)).scalar_one()

    async def _delete(self, stmt: Any, params: dict[str, Any]) -> int:
        with translated_errors():
            async with self.engine.begin() as conn:
                return int((await conn.execute(stmt, params)).rowcount)  # type: ignore[attr-defined]

    async def cutoff(self, seconds: float) -> datetime:
        value: datetime = await self._scalar(self.store.cutoff(), {"seconds": seconds})
        return value

    def _more(self, result: TargetResult) -> bool:
        return self.max_batches is None or result.batches < self.max_batches

    async def _after_batch(self, result: TargetResult) -> None:
        result.batches += 1
        self.progress(result)
        if self.pause:
            await asyncio.sleep(self.pause)

    async def events(
        self, seconds: float, dry_run: bool, after: int, horizon: int | None
    ) -> tuple[TargetResult, int | None]:
        """Returns the result and where the next walk may start (with a ``horizon``)."""
        start = after
        result = TargetResult("events", await self.cutoff(seconds))
        params: dict[str, Any] = {"cutoff": result.cutoff}
        if dry_run:
            result.deleted = int(await self._scalar(self.store.count_published, params))
            return result, None
        # Walk the primary key in windows: every statement touches one bounded id range,
        # and the walk ends at the first window created entirely after the cutoff.
        resume: int | None = None
        while self._more(result):
            with translated_errors():
                async with self.engine.connect() as conn:
                    window = (
                        await conn.execute(
                            self.store.events_window,
                            {"after": after, "scan": self.batch_size, **params},
                        )
                    ).one()
            if not window.n:
                break
            deleted = await self._delete(
                self.store.delete_published, {"after": after, "hi": window.hi, **params}
            )
            result.deleted += deleted
            if resume is None and deleted < window.due:
                resume = after  # due rows another transaction had locked: look again
            elif resume is None and window.kept is not None:
                resume = window.kept - 1
            after = window.hi
            await self._after_batch(result)
            if window.all_young:
                break
        if horizon is None:
            return result, None
        # Everything at or below the horizon was committed or rolled back before the
        # windows were read (relay/sources/table/cursor.py): nothing there can appear later.
        kept = after if resume is None else resume
        return result, max(start, min(after, kept, horizon))

    async def _batched(
        self, target: Target, seconds: float | None, delete: Any, count: Any, dry_run: bool
    ) -> TargetResult:
        """Delete in batches older than ``seconds`` (None: what the rows say has expired)."""
        result = TargetResult(target, None if seconds is None else await self.cutoff(seconds))
        params: dict[str, Any] = {} if seconds is None else {"cutoff": result.cutoff}
        if dry_run:
            result.deleted = int(await self._scalar(count, params))
            return result
        while self._more(result):
            deleted = await self._delete(delete, {"batch": self.batch_size, **params})
            result.deleted += deleted
            await self._after_batch(result)
            if deleted < self.batch_size:
                break
        return result

    async def inbox(self, seconds: float, dry_run: bool) -> TargetResult:
        s = self.store
        return await self._batched("inbox", seconds, s.delete_inbox, s.count_inbox, dry_run)

    async def failed(self, seconds: float, dry_run: bool) -> TargetResult:
        s = self.store
        return await self._batched("failed", seconds, s.delete_failed, s.count_failed, dry_run)

    async def idempotency_records(self, dry_run: bool) -> TargetResult:
        result = TargetResult("idempotency", None)
        if dry_run:
            result.deleted = int(await self._scalar(self.store.count_idempotency, {}))
            return result
        while self._more(result):
            deleted = await self.idempotency.purge_expired_async(
                self.engine, batch_size=self.batch_size, max_batches=1
            )
            result.deleted += deleted
            await self._after_batch(result)
            if deleted < self.batch_size:
                break
        return result

    async def effect_records(self, dry_run: bool) -> TargetResult:
        s = self.store
        return await self._batched("effects", None, s.delete_effects, s.count_effects, dry_run)


async def run_cleanup(
    engine: AsyncEngine,
    settings: OutboxSettings,
    retention: Retention | None = None,
    *,
    batch_size: int = 1000,
    dry_run: bool = False,
    pause_seconds: float = 0.0,
    max_batches: int | None = None,
    progress: Progress | None = None,
    events_after: int = BEFORE_ALL_IDS,
    events_horizon: int | None = None,
) -> CleanupReport:
    """Delete everything past ``retention`` (default: from ``settings``); see the module doc.

    ``max_batches`` bounds the work per table for one call (a maintenance task can run
    often and do a little each time); ``pause_seconds`` sleeps between batches to leave
    I/O to the hot path; ``progress`` is called after every batch.

    ``events_after`` starts the walk of published outbox rows after that id; with
    ``events_horizon`` (an id below which every writer has finished: the relay's claim
    horizon) the report says in ``events_resume_after`` where the next call may start.
    Passing it on keeps a periodic cleanup from walking the dead rows of earlier rounds
    from the start of the table while a snapshot is held.
    """
    retention = retention or Retention.from_settings(settings)
    cleaner = Cleaner(
        engine,
        build_tables(settings),
        IdempotencyKeys(settings),
        batch_size=batch_size,
        pause_seconds=pause_seconds,
        max_batches=max_batches,
        progress=progress,
    )
    report = CleanupReport(dry_run=dry_run)
    started = time.monotonic()
    if retention.published_seconds is not None:
        events, report.events_resume_after = await cleaner.events(
            retention.published_seconds, dry_run, events_after, events_horizon
        )
        report.results.append(events)
    if retention.inbox_seconds is not None:
        report.results.append(await cleaner.inbox(retention.inbox_seconds, dry_run))
    if retention.idempotency:
        report.results.append(await cleaner.idempotency_records(dry_run))
    if retention.effects:
        report.results.append(await cleaner.effect_records(dry_run))
    if retention.failed_seconds is not None:
        report.results.append(await cleaner.failed(retention.failed_seconds, dry_run))
    report.seconds = time.monotonic() - started
    return report
