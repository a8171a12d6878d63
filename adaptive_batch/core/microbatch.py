"""What every way of cutting a step into micro-batches shares: the micro-batch, the controller's interface, the
memory bookkeeping ([`MicroBatchSearch`]), the error. Decisions read all-reduced measurements alone. Pure Python."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from .fit import predict_peak

REGROW_AFTER_STEPS = 1  # steps run at the smaller size before the size that failed is tried again
MAX_FAILURES = 2  # failures at a size (out of memory, or allocator thrash) after which it is not tried again
Agree = Callable[[list[float]], list[float]]  # combines values of all ranks by their maximum


class MicroBatchTooLargeError(RuntimeError):
    """One sample per micro-batch still runs out of memory; `tried`: the sizes that ran out, in order."""

    def __init__(self, message: str, tried: list[int]):
        super().__init__(message)
        self.tried = tried


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch on this rank: `rows` rows from `start` (0: a row that adds nothing), `size` what it stands for
    in the controller's decisions, `last` whether it ends the step's attempt."""

    start: int
    rows: int
    size: int
    timed: bool
    last: bool = False


@dataclass(frozen=True)
class StepMemory:
    """What a step's end tells the controller: its largest micro-batch (`largest` in the unit, `tokens` as run), its
    peak bytes, and whether the allocator freed its cache to retry an allocation (`thrashed`)."""

    largest: int = 0
    tokens: int = 0
    peak_bytes: float | None = None
    thrashed: bool = False


class Cut(Protocol):
    """The micro-batches of one step, as one controller cuts it."""

    def __iter__(self) -> Iterator[MicroBatch]: ...
    def record(self, micro: MicroBatch, report) -> None: ...  # a timed micro-batch, all ranks combined
    def failed_rows(self, micro: MicroBatch, report) -> int: ...  # rows that ran out of memory (on any rank)
    def finish(self, memory: StepMemory) -> str | None: ...  # a line to log where the size changed for memory


class CutController(Protocol):
    """Decides how every step is cut, in one unit (`unit`, for messages); `kind` (`"rows"`, `"tokens"`) is stored in a
    checkpoint; `max_tokens` is `None` where the cut counts rows; `settled_because` says why it stopped measuring."""

    kind: str
    unit: str
    max_tokens: int | None
    settled_because: str | None

    @property
    def exploring(self) -> bool: ...
    @property
    def first_micro_batch_size(self) -> int | None: ...  # where known before the step is cut
    def cut(self, batch, max_rows: int, agree: Agree, row_cap: int | None = None) -> Cut: ...
    def set_row_limit(self, rows: int) -> None: ...  # a step's rows on a rank under a new plan
    def limit_to(self, max_rows: int | None) -> None: ...  # a `max_micro_batch_size` stated on resume
    def larger_step_cap(self, last_micro_batch_size: int, usual_micro_batches: int) -> int | None: ...
    def on_out_of_memory(self, rows: int, padded_tokens: int | None) -> None: ...  # the step runs again
    def retry_message(self, rows: int, padded_tokens: int | None) -> str: ...
    def check_longest_row(self, tokens: int | None) -> None: ...  # warns where a row cannot run
    def describe(self) -> str: ...  # for the plan table
    def accumulation_text(self, per_rank_sizes: list[int], user_accumulation: int) -> str: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class MicroBatchSearch:
    """What the row and the token controller share: the peaks measured, the micro-batches that ran out of memory, and
    a size that failed tried again `REGROW_AFTER_STEPS` later where the peaks predict it fits. Subclasses give:"""

    kind: str  # the checkpoint's name of the cut
    largest_key: str  # the checkpoint's name of `largest_run`
    exploring: bool  # (a property) whether the controller is still measuring
    _thrashed: Callable[[StepMemory], str]  # steps down after allocator thrash; the line to log
    _grow_back: Callable[[int], str]  # runs at a size again; what is tried again, for the log

    def __init__(self, memory_limit: float | None, oom_is_fatal: bool):
        self.memory_limit = memory_limit  # bytes a micro-batch's peak may reach (None: unknown)
        self.oom_is_fatal = oom_is_fatal  # an error cannot be retried: grow only where a bound says it fits
        self.memory_points: list[tuple[float, float]] = []  # (tokens of a micro-batch, peak bytes)
        self.oom_sizes: list[int] = []  # rows of the micro-batches that failed
        self.shrunk_from: int | None = None  # the size to try again
        self.steps_since_shrink = 0
        self.largest_run = 0  # the largest micro-batch of a step that ran to its end, in the unit's size
        self.tried_again: list[int] = []  # sizes tried again, once each time
        self.failed_this_step = False
        self.settled_because: str | None = None

    def fits(self, tokens: float, cautious: bool = False) -> bool:
        if self.memory_limit is None:
            return True
        return predict_peak(self.memory_points, tokens, cautious or self.oom_is_fatal) <= self.memory_limit

    def _measured(self, tokens: float, peak_bytes: float | None) -> None:
        if peak_bytes is not None:
            self.memory_points.append((float(tokens), float(peak_bytes)))

    def _out_of_memory(self, rows: int) -> None:
        self.oom_sizes.append(rows)
        if rows == 1:
            raise MicroBatchTooLargeError(
                "one sample per micro-batch runs out of memory", list(self.oom_sizes)
            )

    def _failed(self, size: int, had_run: bool) -> None:
        """A micro-batch under `size` failed: try `size` again later where it had run (first failure of a step)."""
        if self.failed_this_step:
            return
        self.failed_this_step = True
        again = had_run and self.tried_again.count(size) < MAX_FAILURES - 1
        self.shrunk_from = size if again else None
        self.steps_since_shrink = 0

    def _after_step(self, memory: StepMemory, largest: int, tokens_per_unit: float) -> str | None:
        """The memory side of a finished step: a step down for thrash, or a failed size tried again; the log line."""
        self._measured(memory.tokens, memory.peak_bytes if memory.tokens > 0 else None)
        self.largest_run = max(self.largest_run, largest)
        self.failed_this_step = False
        if memory.thrashed and memory.largest > 1 and not self.exploring:
            return self._thrashed(memory)
        if self.shrunk_from is None:
            return None
        self.steps_since_shrink += 1
        size = self.shrunk_from
        fits = self.fits(size * tokens_per_unit, cautious=True)
        if self.steps_since_shrink < REGROW_AFTER_STEPS or not fits:
            return None
        self.shrunk_from = None
        self.tried_again.append(size)
        return tried_again_text(self._grow_back(size), self.tried_again.count(size))

    def _search_state(self) -> dict:
        return {
            "kind": self.kind,
            "settled_because": self.settled_because,
            "shrunk_from": self.shrunk_from,
            "steps_since_shrink": self.steps_since_shrink,
            self.largest_key: self.largest_run,
            "tried_again": list(self.tried_again),
            "memory_points": [list(point) for point in self.memory_points],
            "oom_sizes": list(self.oom_sizes),
        }

    def _load_search_state(self, state: dict) -> None:
        self.settled_because = state["settled_because"]
        self.shrunk_from = state["shrunk_from"]
        self.steps_since_shrink = int(state["steps_since_shrink"])
        self.largest_run = int(state[self.largest_key])
        self.tried_again = [int(size) for size in state["tried_again"]]
        self.memory_points = [(float(t), float(p)) for t, p in state["memory_points"]]
        self.oom_sizes = [int(size) for size in state["oom_sizes"]]


def least(*values: int | None) -> int | None:
    """The smallest of the values given (not `None`), or `None` where none is: the tightest of optional caps."""
    return min((value for value in values if value is not None), default=None)


def out_of_memory_text(fatal: bool, retry: str) -> str:
    if fatal:
        return (
            "an out-of-memory error cannot be retried under this engine and world size, so sizes grow only where "
            "measured peaks bound them below the limit"
        )
    return f"{retry} on out-of-memory"


def tried_again_text(what: str, times: int) -> str:
    n = MAX_FAILURES - 1 - times
    rest = f"it may fail {n} more time(s) before it stays below" if n else "if it fails again, it stays below"
    return (
        f"Trying {what} again: its out-of-memory error (or allocator thrash) may have been one long step or a "
        f"fragmented moment; {rest}."
    )
