"""The lines the package fits: peak memory or step time against the size of a micro-batch.

Peak memory and step time are both close to affine in the batch (a fixed part plus a part per sample or token),
and the memory policy ([`predict_peak`]), the boundary search ([`boundary.predict_boundary`]) and the
throughput trial ([`boundary.next_throughput_size`]) each read a prediction off such a line ([`affine`]).

The time of single micro-batches is another matter: a compile, a new shape or a busy host now and then makes one
several times slower, never faster. [`robust_affine`] fits those: one such point in four leaves its line unmoved,
where it can tip a least-squares line to a falling one.

Pure Python: no torch, no transformers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def affine(points: Iterable[tuple[float, float]]) -> tuple[float, float] | None:
    """The least-squares line `y = intercept + slope x` through `points`, as `(intercept, slope)`.

    `None` with fewer than two distinct `x`: a line through one abscissa has no slope.

    Example:
        ```python
        affine([(1, 3), (2, 5), (4, 9)])  # (1.0, 2.0): y = 1 + 2x
        ```
    """
    points = list(points)
    if len({x for x, _ in points}) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return mean_y - slope * mean_x, slope


def robust_affine(points: Iterable[tuple[float, float]]) -> tuple[float, float] | None:
    """The Theil-Sen line through `points`, as `(intercept, slope)`: the slope is the median of the slopes between
    every two points of distinct `x`, the intercept the median of `y - slope x`. Points far off the line move it
    little while fewer than about 29% of them are off.

    `None` with fewer than two distinct `x`.

    Example:
        ```python
        robust_affine([(1, 3), (2, 5), (3, 40), (4, 9), (5, 11)])  # (1.0, 2.0): the point at 3 is ignored
        ```
    """
    points = list(points)
    slopes = [
        (y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1 :] if x2 != x1
    ]
    if not slopes:
        return None
    slope = _median(slopes)
    return _median([y - slope * x for x, y in points]), slope


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def predict_peak(points: list[tuple[float, float]], tokens: float, cautious: bool = False) -> float:
    """Least-squares affine fit of peak bytes against tokens per micro-batch, evaluated at `tokens`.

    With fewer than two distinct token counts no line can be fitted. Then 0 is returned (assume it fits: an
    out-of-memory error only costs a retry), or with `cautious` (where it cannot be retried) an upper bound: a peak
    affine in tokens with a non-negative intercept (the weights, the optimizer state) grows at most in proportion,
    so `tokens` needs at most the largest measured peak scaled by `tokens` over its tokens; with no point at all,
    infinity (nothing known, nothing fits).
    """
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
