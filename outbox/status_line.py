"""The daemons' periodic status line, shared by the relay and the consumer.

Written every ``status.interval_seconds``; in the default ``changed`` mode at INFO only when
a figure differs from the last line written (or, for the first, from the figures at start),
otherwise at DEBUG — so an idle daemon writes nothing at INFO, where a line every 10 s used
to be most of its log. Figures that move by themselves while nothing happens (the age of
the oldest pending row or snapshot, the WAL behind the slot) are shown but not compared.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from outbox.settings import StatusSettings

UNKNOWN = "unknown"  # a figure that could not be measured (the database down): never 0

Figures = Mapping[str, int | float | str]


class StatusLine:
    """``line.report(figures)`` once per ``line.interval``; it decides the level."""

    def __init__(
        self,
        log: logging.Logger,
        message: str,
        settings: StatusSettings,
        *,
        start: Figures,
        drifting: Iterable[str] = (),
        fields: Mapping[str, Any] | None = None,
    ) -> None:
        self.interval = settings.interval_seconds
        self._log, self._message, self._always = log, message, settings.mode == "always"
        self._drifting = frozenset(drifting)
        self._fields = dict(fields or {})
        self._last = self._compared(start)

    def report(self, figures: Figures) -> None:
        compared = self._compared(figures)
        changed = compared != self._last
        level = logging.INFO if changed or self._always else logging.DEBUG
        if changed:
            self._last = compared
        self._log.log(level, self._message, extra={**self._fields, **figures})

    def _compared(self, figures: Figures) -> dict[str, int | float | str]:
        return {k: v for k, v in figures.items() if k not in self._drifting}
