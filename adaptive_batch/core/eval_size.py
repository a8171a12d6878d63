"""The eval batch under `adapt_evaluation="grow"`: doubled between evaluations while rows/s rise and memory allows.
See docs/how-it-works.md, "Evaluation". Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EvalMeasure:
    """One evaluation over all ranks: `rows` per rank, `seconds` of the slowest, `largest` the largest piece run."""

    size: int
    rows: int
    seconds: float
    largest: int
    peak_bytes: float | None = None
    base_bytes: float | None = None
    limit_bytes: float | None = None


@dataclass
class EvalSizer:
    """Chooses each evaluation's per-device eval batch, starting at `start`."""

    start: int
    growth_margin: float = 0.01
    memory_headroom: float = 0.10
    size: int = field(init=False)
    settled_because: str | None = field(default=None, init=False)
    best: tuple[int, float] | None = field(default=None, init=False)  # (size, rows/s) of the fastest so far
    history: list[tuple[int, float]] = field(default_factory=list, init=False)

    def __post_init__(self):
        self.size = self.start

    def batch_size(self, rows_per_rank: int | None) -> int:
        if rows_per_rank is None or rows_per_rank <= 0:
            return self.size
        return max(1, min(self.size, rows_per_rank))

    def record(self, measure: EvalMeasure) -> str | None:
        """Learn from an evaluation; returns a line to log where the size changed or settled."""
        if self.settled_because is not None:
            if measure.largest < self.size:  # a later out-of-memory error: keep what ran
                self.size = measure.largest
                return (
                    f"Eval batch: {measure.largest}, the largest piece that ran after an out-of-memory error."
                )
            return None
        if measure.largest < measure.size:
            self.size = measure.largest
            return self._settle(f"an eval batch of {measure.size} ran out of memory; {measure.largest} ran")
        if measure.seconds <= 0 or measure.rows <= 0:
            return None  # nothing timed (an empty eval set)
        rate = measure.rows / measure.seconds
        self.history.append((measure.size, rate))
        if self.best is not None and rate < self.best[1] * (1 + self.growth_margin):
            size, best_rate = self.best
            self.size = size
            return self._settle(
                f"{measure.size} ran {rate:,.1f} rows/s against {best_rate:,.1f} at {size} (less than "
                f"{self.growth_margin:.0%} more)"
            )
        if self.best is None or rate > self.best[1]:
            self.best = (measure.size, rate)
        if measure.rows <= measure.size:
            self.size = measure.size
            return self._settle(f"{measure.size} holds the whole eval set of {measure.rows} rows per rank")
        grown = 2 * measure.size
        if measure.peak_bytes is not None and measure.base_bytes is not None and measure.limit_bytes:
            per_row = max(0.0, measure.peak_bytes - measure.base_bytes) / measure.size
            predicted = measure.base_bytes + per_row * grown
            allowed = (1 - self.memory_headroom) * measure.limit_bytes
            if predicted > allowed:
                return self._settle(
                    f"{grown} is predicted to need {predicted / 2**30:.1f} GiB of the {allowed / 2**30:.1f} GiB "
                    "allowed"
                )
        self.size = grown
        return f"Eval batch: {grown} next ({measure.size} ran {rate:,.1f} rows/s)."

    def _settle(self, why: str) -> str:
        self.settled_because = why
        return f"Eval batch settled at {self.size}: {why}."
