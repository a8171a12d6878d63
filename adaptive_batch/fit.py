"""The one least-squares line the package fits: peak memory or step time against the size of a micro-batch.

Peak memory and step time are both close to affine in the batch (a fixed part plus a part per sample or token),
and the memory policy ([`microbatch.predict_peak`]), the boundary search ([`boundary.predict_boundary`]) and the
throughput trial ([`boundary.next_throughput_size`]) each read a prediction off such a line.

Pure Python: no torch, no transformers.
"""

from __future__ import annotations

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
