"""The eval batch under `adapt_evaluation="grow"`: from `per_device_eval_batch_size`, doubled from one evaluation
to the next while the eval set's rows per second rise by at least `growth_margin` and the doubled batch's
predicted memory fits; then kept.

Each evaluation runs at one size on every rank (the data loader's batch size, so that the Trainer's loss weighting,
accelerate's even batches and its removal of repeated rows stay as the Trainer has them). After it, the sizer is
told what it measured: its seconds, the rows it ran, and on a GPU the peak bytes above what was allocated when it
began. Memory is modelled as linear in the batch's rows at the eval set's widest batch: the next size's peak is
`base + (peak - base) x next / size`, and it must stay under `(1 - headroom) x limit`. Without a measure of memory
(the CPU) the batch grows while it pays; an out-of-memory error runs the batch in pieces
([`runtime.evaluation`]) and keeps the largest piece that ran as the eval batch from then on.

Every decision depends only on what it is told, so ranks that are told the same (the slowest rank's seconds, the
largest peak) choose the same sizes. Pure Python: no torch, no transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EvalMeasure:
    """What one evaluation measured, over all ranks: `rows` per rank, `seconds` of the slowest rank, `peak_bytes`
    and `base_bytes` (`None` without a measure of memory) and `limit_bytes` the device's memory; `largest` the
    largest piece that ran (below `size` after an out-of-memory error)."""

    size: int
    rows: int
    seconds: float
    largest: int
    peak_bytes: float | None = None
    base_bytes: float | None = None
    limit_bytes: float | None = None


@dataclass
class EvalSizer:
    """Chooses each evaluation's per-device eval batch.

    Args:
        start: `per_device_eval_batch_size`.
        growth_margin: the rows/s gain a doubled batch must bring to be kept.
        memory_headroom: the share of the device's memory a predicted peak leaves free.
    """

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
        """The eval batch for an evaluation of `rows_per_rank` rows (`None`: unknown): never more than it holds."""
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
