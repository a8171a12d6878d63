"""The lines the package fits, on `statistics`: peak memory and step time against a micro-batch's size, both close
to affine; [`robust_affine`] for times, which a compile or a busy host slows now and then. Pure Python."""

from __future__ import annotations

import math
from collections.abc import Iterable
from statistics import linear_regression, median


def affine(points: Iterable[tuple[float, float]]) -> tuple[float, float] | None:
    """The least-squares line through `points`, as `(intercept, slope)`; `None` with fewer than two distinct `x`."""
    points = list(points)
    if len({x for x, _ in points}) < 2:
        return None
    line = linear_regression([x for x, _ in points], [y for _, y in points])
    return line.intercept, line.slope


def robust_affine(points: Iterable[tuple[float, float]]) -> tuple[float, float] | None:
    """The Theil-Sen line through `points`, as `(intercept, slope)`: the median pairwise slope and the median of
    `y - slope x`, which up to about 29% of outliers move little; `None` with fewer than two distinct `x`."""
    points = list(points)
    slopes = [
        (y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1 :] if x2 != x1
    ]
    if not slopes:
        return None
    slope = median(slopes)
    return median([y - slope * x for x, y in points]), slope


def plane(
    points: list[tuple[int, int, float]], through_origin: bool = False
) -> tuple[float, float, float] | None:
    """The least-squares `z = c + a x + b y` through `(x, y, z)` points, as `(c, a, b)`, by Frisch-Waugh-Lovell;
    `None` where the `(x, y)` lie on one line (through the origin, `through_origin`, where `c` = 0)."""
    x0, y0 = (0, 0) if through_origin or not points else points[0][:2]
    vectors = [(x - x0, y - y0) for x, y, _ in points]
    if not any(u[0] * v[1] != u[1] * v[0] for u in vectors for v in vectors):
        return None
    xs, ys, zs = ([point[i] for point in points] for i in range(3))

    def left(values: list[float]) -> list[float]:  # what the line on x leaves of `values`
        line = linear_regression(xs, values, proportional=through_origin)
        return [value - line.intercept - line.slope * x for x, value in zip(xs, values)]

    b = linear_regression(left(ys), left(zs), proportional=True).slope
    line = linear_regression(xs, [z - b * y for y, z in zip(ys, zs)], proportional=through_origin)
    return line.intercept, line.slope, b


def predict_peak(points: list[tuple[float, float]], tokens: float, cautious: bool = False) -> float:
    """Peak bytes at `tokens` per micro-batch, from the line of peak bytes against tokens; without a line, 0 (a retry
    is cheap), or `cautious` the largest measured peak scaled up in proportion (infinity with no point)."""
    line = affine(points)
    if line is not None:
        intercept, slope = line
        return intercept + slope * tokens
    if not cautious:
        return 0.0
    measured = [(t, peak) for t, peak in points if t > 0]
    if not measured:
        return math.inf
    most, peak = max(measured)
    return peak * max(1.0, tokens / most)
