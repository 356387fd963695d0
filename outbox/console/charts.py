"""Charts drawn on the server as SVG (no script, no library): a time chart with its axes —
times (UTC) along the bottom, values with their unit up the side, a tick at each round
number — and sparklines, small lines of the last hour with their latest and highest value
said in words next to them.

Everything here is geometry over plain numbers; the templates turn it into ``<svg>``
(``templates/_charts.html``).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Point = tuple[float, float | None]  # (time.time(), value); None: no figure then (a gap)


@dataclass(frozen=True)
class Tick:
    at: float  # pixels from the plot's origin along its axis
    label: str


@dataclass(frozen=True)
class Line:
    name: str
    css: str  # the class that colours it (console.css)
    paths: tuple[str, ...]  # polyline point lists, one per stretch without a gap
    last: float | None


@dataclass(frozen=True)
class TimeChart:
    width: int
    height: int
    left: int  # the plot area, inside the axes
    top: int
    right: int
    bottom: int
    unit: str
    lines: tuple[Line, ...]
    x_ticks: tuple[Tick, ...]
    y_ticks: tuple[Tick, ...]
    start: dt.datetime
    end: dt.datetime
    empty: bool


def nice_step(top: float, ticks: int = 4) -> float:
    """A round step (1, 2 or 5 times a power of ten) giving about ``ticks`` steps to
    ``top``."""
    if top <= 0:
        return 1.0
    raw = top / ticks
    power = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 5, 10):
        if raw <= factor * power:
            return float(factor * power)
    return float(10 * power)  # pragma: no cover - the loop always returns


def value_label(value: float) -> str:
    """``0``, ``1.5``, ``250``, ``12k``, ``3.5M``."""
    for size, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            return f"{value / size:g}{suffix}"
    return f"{value:g}" if value == int(value) else f"{value:.2g}"


def _segments(
    points: Sequence[Point], x: Callable[[float], float], y: Callable[[float], float]
) -> tuple[str, ...]:
    """SVG point lists of ``points``, broken where a value is None."""
    paths: list[str] = []
    current: list[str] = []
    for at, value in points:
        if value is None:
            if current:
                paths.append(" ".join(current))
            current = []
            continue
        current.append(f"{x(at):.1f},{y(value):.1f}")
    if current:
        paths.append(" ".join(current))
    return tuple(paths)


def time_chart(
    lines: Sequence[tuple[str, str, Sequence[Point]]],
    *,
    start: float,
    end: float,
    unit: str,
    width: int = 640,
    height: int = 180,
) -> TimeChart:
    """A chart of ``lines`` — (name, css class, points) — from ``start`` to ``end``
    (``time.time()`` values): times every 10 minutes (every 5 or 1 for shorter spans)
    along the bottom, round values of ``unit`` up the side, from 0."""
    left, top, right, bottom = 56, 24, width - 12, height - 28
    span = max(1.0, end - start)
    values = [v for _, _, pts in lines for _, v in pts if v is not None]
    peak = max([0.0, *values])
    step = nice_step(peak or 1.0)
    ceiling = step * max(1, math.ceil(peak / step))

    def x(at: float) -> float:
        return left + (right - left) * (at - start) / span

    def y(value: float) -> float:
        return bottom - (bottom - top) * value / ceiling

    y_ticks = tuple(
        Tick(y(step * i), value_label(step * i)) for i in range(round(ceiling / step) + 1)
    )
    every = 600 if span > 1800 else 300 if span > 600 else 60
    first = math.ceil(start / every) * every
    x_ticks = tuple(
        Tick(x(t), dt.datetime.fromtimestamp(t, dt.UTC).strftime("%H:%M"))
        for t in range(int(first), int(end) + 1, every)
    )
    drawn = tuple(
        Line(
            name,
            css,
            _segments([(at, v) for at, v in pts if start <= at <= end], x, y),
            next((v for _, v in reversed(pts) if v is not None), None),
        )
        for name, css, pts in lines
    )
    return TimeChart(
        width,
        height,
        left,
        top,
        right,
        bottom,
        unit,
        drawn,
        x_ticks,
        y_ticks,
        dt.datetime.fromtimestamp(start, dt.UTC),
        dt.datetime.fromtimestamp(end, dt.UTC),
        empty=not values,
    )


@dataclass(frozen=True)
class Sparkline:
    width: int
    height: int
    paths: tuple[str, ...]
    last: float | None
    peak: float | None
    unit: str
    dot: tuple[float, float] | None = None  # the latest point (a line of one is no line)

    @property
    def summary(self) -> str:
        """What the line says, in words (also its SVG title)."""
        if self.last is None and self.peak is None:
            return "no figures in the last hour"
        last = "none" if self.last is None else f"{_figure(self.last)} {self.unit}"
        peak = "-" if self.peak is None else _figure(self.peak)
        return f"now {last}, peak {peak} {self.unit} (last hour)"


def _figure(value: float) -> str:
    """Two significant digits below 100 (``0.033``, ``9.6``, ``42``), else a label."""
    return f"{value:.2g}" if abs(value) < 100 else value_label(round(value))


def sparkline(
    points: Sequence[Point],
    *,
    start: float,
    end: float,
    unit: str,
    width: int = 120,
    height: int = 24,
) -> Sparkline:
    """A line of ``points`` from ``start`` to ``end``, 0 at the bottom."""
    values = [v for _, v in points if v is not None]
    peak = max(values) if values else None
    span = max(1.0, end - start)
    ceiling = peak or 1.0

    def x(at: float) -> float:
        return 1 + (width - 2) * (at - start) / span

    def y(value: float) -> float:
        return height - 1 - (height - 2) * value / ceiling

    last = points[-1][1] if points else None
    latest = next(((at, v) for at, v in reversed(points) if v is not None), None)
    dot = (round(x(latest[0]), 1), round(y(latest[1]), 1)) if latest else None
    return Sparkline(width, height, _segments(points, x, y), last, peak, unit, dot)
