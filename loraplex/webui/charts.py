"""Line charts drawn by the server as inline SVG (no script, no third-party library).

Geometry only: ``line_chart`` maps series onto a ``viewBox`` of ``n - 1`` by ``HEIGHT`` units that
the template stretches to the box (``preserveAspectRatio="none"``, strokes with
``vector-effect: non-scaling-stroke``). Text (axis labels, legend) is HTML beside the SVG, so it
stays readable at any width instead of shrinking with the drawing. A gap in the data (``None``)
breaks a line into segments; a lone point becomes a short dash.

    y=0 ┌──────────────────────────────┐  <- y_max
        │     ╱╲      ___              │
        │ ___╱  ╲____╱   ╲___          │  <- y_max / 2
        │                              │
 HEIGHT └──────────────────────────────┘  <- 0
        x=0 (an hour ago)     x=n-1 (now)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

HEIGHT = 100.0


@dataclass(frozen=True)
class Line:
    label: str
    css_class: str  # the stroke colour comes from the stylesheet
    segments: tuple[str, ...]  # each an SVG polyline ``points`` attribute


@dataclass(frozen=True)
class Chart:
    title: str
    width: int  # viewBox width: number of points - 1 (at least 1)
    height: float
    lines: tuple[Line, ...]
    y_labels: tuple[str, str, str]  # top, middle, bottom
    x_labels: tuple[str, ...]  # evenly spaced, left to right
    empty: bool  # no data point at all
    summary: str  # one sentence for screen readers and as a caption

    @property
    def grid_ys(self) -> tuple[float, float, float]:
        return (0.0, self.height / 2, self.height)


def nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 (times a power of ten) that is at least ``value`` (> 0)."""
    if value <= 0 or not math.isfinite(value):
        return 1.0
    power = 10.0 ** math.floor(math.log10(value))
    for step in (1.0, 2.0, 2.5, 5.0, 10.0):
        if value <= step * power * (1 + 1e-9):
            return step * power
    return 10.0 * power


def _segments(values: Sequence[float | None], y_max: float) -> tuple[str, ...]:
    def y(v: float) -> str:
        return f"{HEIGHT - min(v, y_max) / y_max * HEIGHT:.2f}"

    segments: list[str] = []
    run: list[tuple[int, float]] = []
    for i, v in enumerate([*values, None]):
        if v is not None:
            run.append((i, v))
            continue
        if len(run) == 1:  # a lone point: a dash one unit wide, centred on it
            ((j, w),) = run
            segments.append(f"{j - 0.5:.1f},{y(w)} {j + 0.5:.1f},{y(w)}")
        elif run:
            segments.append(" ".join(f"{j},{y(w)}" for j, w in run))
        run = []
    return tuple(segments)


def line_chart(
    title: str,
    series: Sequence[tuple[str, str, Sequence[float | None]]],
    *,
    fmt: Callable[[float], str],
    x_labels: tuple[str, ...],
    summary: str,
    y_max: float | None = None,
) -> Chart:
    """A chart of ``series`` (label, css class, values; all the same length) from y = 0 to
    ``y_max`` (default: a round number above the data)."""
    n = max((len(values) for _, _, values in series), default=0)
    points = [v for _, _, values in series for v in values if v is not None]
    y_max = y_max or nice_ceiling(max(points, default=0.0))
    lines = tuple(
        Line(label, css_class, _segments(values, y_max)) for label, css_class, values in series
    )
    return Chart(
        title=title,
        width=max(1, n - 1),
        height=HEIGHT,
        lines=lines,
        y_labels=(fmt(y_max), fmt(y_max / 2), "0"),
        x_labels=x_labels,
        empty=not points,
        summary=summary,
    )
