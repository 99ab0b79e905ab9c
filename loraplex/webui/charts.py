"""Line charts drawn by the server as inline SVG (no script, no third-party library).

Geometry only: ``line_chart`` maps series onto a ``viewBox`` of ``n - 1`` by ``HEIGHT`` units that
the template stretches to the box (``preserveAspectRatio="none"``, strokes with
``vector-effect: non-scaling-stroke``). Text (axis labels, legend) is HTML beside the SVG, so it
stays readable at any width instead of shrinking with the drawing. A gap in the data (``None``)
breaks a line into segments; a lone point (gaps on both sides) is a dot: a circle in a second,
unstretched SVG over the plot, placed in percent of the plot's box, so it stays round at any
width (a segment would be a dash, or nothing, once stretched).

    y=0 ┌──────────────────────────────┐  <- y_max
        │     ╱╲      ___        •     │
        │ ___╱  ╲____╱   ╲___          │  <- y_max / 2
        │                              │
 HEIGHT └──────────────────────────────┘  <- 0
        x=0 (an hour ago)     x=n-1 (now)

A log scale (``scale="log"``, or ``"auto"`` when the data spans more than ``LOG_SPREAD``) runs
from the power of ten below the smallest value to the one above the largest, a grid line and a
label at each power, so a small series stays readable beside one a hundred times larger.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

HEIGHT = 100.0
LOG_SPREAD = 10.0  # "auto" draws a log scale when the largest value is over 10x the smallest

Scale = Literal["linear", "log", "auto"]


@dataclass(frozen=True)
class Line:
    label: str
    css_class: str  # the stroke colour comes from the stylesheet
    segments: tuple[str, ...]  # each an SVG polyline ``points`` attribute (two points or more)
    dots: tuple[tuple[float, float], ...] = ()  # lone points: (x, y) in percent of the plot


@dataclass(frozen=True)
class Chart:
    title: str
    width: int  # viewBox width: number of points - 1 (at least 1)
    height: float
    lines: tuple[Line, ...]
    y_labels: tuple[str, ...]  # top to bottom, evenly spaced (at least two)
    x_labels: tuple[str, ...]  # evenly spaced, left to right
    empty: bool  # no data point at all
    summary: str  # one sentence for screen readers and as a caption
    log: bool = False  # a log scale: y_labels are powers of ten

    @property
    def grid_ys(self) -> tuple[float, ...]:
        steps = max(1, len(self.y_labels) - 1)
        return tuple(self.height * i / steps for i in range(steps + 1))

    @property
    def has_dots(self) -> bool:
        return any(line.dots for line in self.lines)


def nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 (times a power of ten) that is at least ``value`` (> 0)."""
    if value <= 0 or not math.isfinite(value):
        return 1.0
    power = 10.0 ** math.floor(math.log10(value))
    for step in (1.0, 2.0, 2.5, 5.0, 10.0):
        if value <= step * power * (1 + 1e-9):
            return step * power
    return 10.0 * power


def _line(label: str, css_class: str, values: Sequence[float | None], to_y: Callable[[float], float],
          width: int) -> Line:  # fmt: skip
    segments: list[str] = []
    dots: list[tuple[float, float]] = []
    run: list[tuple[int, float]] = []
    for i, v in enumerate([*values, None]):
        if v is not None:
            run.append((i, v))
            continue
        if len(run) == 1:
            ((j, w),) = run
            dots.append((round(j / width * 100, 2), round(to_y(w) / HEIGHT * 100, 2)))
        elif run:
            segments.append(" ".join(f"{j},{to_y(w):.2f}" for j, w in run))
        run = []
    return Line(label, css_class, tuple(segments), tuple(dots))


def _decades(points: Sequence[float]) -> tuple[int, int]:
    """The powers of ten just below the smallest positive point and just above the largest."""
    positive = [p for p in points if p > 0] or [1.0]
    low = math.floor(math.log10(min(positive)) + 1e-9)
    high = math.ceil(math.log10(max(positive)) - 1e-9)
    return low, max(high, low + 1)


def line_chart(
    title: str,
    series: Sequence[tuple[str, str, Sequence[float | None]]],
    *,
    fmt: Callable[[float], str],
    x_labels: tuple[str, ...],
    summary: str,
    y_max: float | None = None,
    scale: Scale = "linear",
) -> Chart:
    """A chart of ``series`` (label, css class, values; all the same length): from y = 0 to
    ``y_max`` (default: a round number above the data), or on a log scale (see the module)."""
    n = max((len(values) for _, _, values in series), default=0)
    width = max(1, n - 1)
    points = [v for _, _, values in series for v in values if v is not None]
    positive = [p for p in points if p > 0]
    log = scale == "log" or (
        scale == "auto" and bool(positive) and max(positive) > LOG_SPREAD * min(positive)
    )
    to_y: Callable[[float], float]
    if log:
        low, high = _decades(points)

        def to_y(v: float) -> float:
            exponent = math.log10(v) if v > 0 else low
            exponent = min(max(exponent, low), high)
            return HEIGHT - (exponent - low) / (high - low) * HEIGHT

        y_labels = tuple(fmt(10.0**k) for k in range(high, low - 1, -1))
    else:
        top = y_max or nice_ceiling(max(points, default=0.0))

        def to_y(v: float) -> float:
            return HEIGHT - min(v, top) / top * HEIGHT

        y_labels = (fmt(top), fmt(top / 2), "0")
    lines = tuple(_line(label, css, values, to_y, width) for label, css, values in series)
    return Chart(
        title=title,
        width=width,
        height=HEIGHT,
        lines=lines,
        y_labels=y_labels,
        x_labels=x_labels,
        empty=not points,
        summary=summary,
        log=log,
    )
