"""What every way of cutting a step into micro-batches shares: the micro-batch, the controller's interface, the error.

A controller decides how each optimizer step is cut, by one unit: [`rows.RowController`] by rows (samples, or the
sequences of a padding-free row), [`tokens.TokenController`] by padded tokens. The step runner asks it for a
[`Cut`] of each step, runs the micro-batches the cut yields, tells the cut what each timed one measured, and tells
the controller when one ran out of memory. [`controllers.controller_for`] picks the controller for a run.

All decisions depend only on the measurements fed in and the rows of the step, so ranks that are fed the same
(all-reduced) measurements make the same decisions and run the same number of micro-batches.

Pure Python: no torch, no transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol


class MicroBatchTooLargeError(RuntimeError):
    """One sample per micro-batch still runs out of memory. `tried` holds the sizes that ran out, in order."""

    def __init__(self, message: str, tried: list[int]):
        super().__init__(message)
        self.tried = tried


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a step on this rank: `rows` rows from `start` of the step batch's order (0 rows: a row that
    adds nothing, for a rank with fewer), `size` the size it stands for in the controller's decisions, `timed`
    whether its time and memory are measured, `last` whether it ends the step's attempt (on every rank alike)."""

    start: int
    rows: int
    size: int
    timed: bool
    last: bool = False


@dataclass(frozen=True)
class StepMemory:
    """What a step's end tells the controller about memory: the largest micro-batch it ran (`largest` in the
    controller's unit, `tokens` as run), the step's peak bytes (`None` where not measured: the CPU), and whether the
    caching allocator had to free its cache to retry an allocation during the step (`thrashed`: memory is nearly
    full, and the next allocation may fail)."""

    largest: int = 0
    tokens: int = 0
    peak_bytes: float | None = None
    thrashed: bool = False


class Cut(Protocol):
    """The micro-batches of one step, as one controller cuts it."""

    def __iter__(self) -> Iterator[MicroBatch]: ...

    def record(self, micro: MicroBatch, report) -> None:
        """What a timed micro-batch measured (`report`: seconds, tokens, peak bytes, all ranks combined)."""

    def failed_rows(self, micro: MicroBatch, report) -> int:
        """The rows of the micro-batch that ran out of memory (on any rank)."""

    def finish(self, memory: StepMemory) -> str | None:
        """The step ran to its end; returns a line to log where the controller changed its size for memory."""


class CutController(Protocol):
    """Decides how every step is cut into micro-batches, in one unit (`unit`).

    Attributes:
        kind: `"rows"` or `"tokens"`, as stored in a checkpoint.
        unit: what its sizes count, for messages ("rows", "padded tokens").
        max_tokens: the padded tokens a micro-batch may hold; `None` where the cut counts rows.
        exploring: still measuring (a trial size, the overhead of a micro-batch, a growing budget).
        settled_because: why it stopped measuring, for the log; `None` while it measures.
    """

    kind: str
    unit: str
    max_tokens: int | None
    settled_because: str | None

    @property
    def exploring(self) -> bool: ...

    @property
    def first_micro_batch_size(self) -> int | None:
        """Rows the first micro-batch of the next step holds, where that is known before it is cut."""

    def cut(
        self, batch, max_rows: int, agree: Callable[[list[float]], list[float]], row_cap: int | None = None
    ) -> Cut:
        """The micro-batches of a step whose batch holds `batch.rows` rows on this rank and `max_rows` on the rank
        with most; `agree` combines values of all ranks by their maximum; at most `row_cap` rows each (this step)."""

    def set_row_limit(self, rows: int) -> None:
        """A step holds up to `rows` rows on a rank now (a new plan): the most a micro-batch may hold."""

    def limit_to(self, max_rows: int | None) -> None:
        """Apply a `max_micro_batch_size` stated after the size was learned (a resumed run)."""

    def larger_step_cap(self, last_micro_batch_size: int, usual_micro_batches: int) -> int | None:
        """The most rows a micro-batch of a larger step than today's may hold, as far as known (`None`: as many as
        memory allows), for a schedule that models the time of larger steps."""

    def on_out_of_memory(self, rows: int, padded_tokens: int | None) -> None:
        """A micro-batch of `rows` rows and `padded_tokens` ran out of memory; the step will run again.

        Raises:
            MicroBatchTooLargeError: if it was one row.
        """

    def retry_message(self, rows: int, padded_tokens: int | None) -> str: ...

    def check_longest_row(self, tokens: int | None) -> None:
        """Before any compute: the dataset's longest row, where known (a controller that cannot run it warns)."""

    def describe(self) -> str:
        """How each step is cut, for the plan table."""

    def accumulation_text(self, per_rank_sizes: list[int], user_accumulation: int) -> str:
        """Micro-batches per step, for the plan table (`per_rank_sizes`: a rank's samples per step, per phase)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...
