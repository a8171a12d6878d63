"""The micro-batch policy by rows: with `auto` the size doubles while tokens/s gain more than `growth_margin`, or
halves while that pays where the first doubling does not; trials run inside steps. Pure Python."""

from __future__ import annotations

import math

from .microbatch import MicroBatch, MicroBatchSearch, StepMemory, least, out_of_memory_text


def even_chunk(remaining: int, size: int) -> int:
    """The next micro-batch when `remaining` rows are cut into as few near-equal chunks of at most `size`: 10 rows at
    4 give 4, 3, 3 (not 4, 4, 2), as many micro-batches at a lower peak."""
    chunks = math.ceil(remaining / size)
    return math.ceil(remaining / chunks)


DECISIVE = 5  # a gain of this many margins needs no second measurement
REPEATS = 2  # micro-batches timed per trial, the best counting
FIXED = "fixed by micro_batch_size"


class RowController(MicroBatchSearch):
    """Chooses the rows of every micro-batch (a [`microbatch.CutController`] whose unit is rows); `row_tokens`: a
    packed row's tokens (TRL's `packing=True`), its micro-batches then runs of whole sequences ([`PackedRowCut`])."""

    kind = "rows"
    max_tokens = None  # the cut counts rows
    largest_key = "largest_run"

    def __init__(
        self,
        start: int,
        auto: bool = True,
        max_size: int | None = None,
        row_limit: int | None = None,
        growth_margin: float = 0.01,
        memory_limit: float | None = None,
        oom_is_fatal: bool = False,
        row_tokens: int | None = None,
    ):
        super().__init__(memory_limit, oom_is_fatal)
        self.auto = auto
        self.start = max(1, start)  # a fixed size held down by a step's rows comes back when steps grow
        self.size = max(1, least(start, max_size, row_limit))
        self.max_size, self.row_limit, self.growth_margin = max_size, row_limit, growth_margin
        self.trial: int | None = self.size if auto else None
        self.trial_left = REPEATS
        self.settled_because = None if auto else FIXED
        self.throughput: dict[int, float] = {}
        self.row_tokens = row_tokens
        self.unit = "packed rows" if row_tokens else "rows"
        self.stopped_by_limit = False  # the search stopped at max_micro_batch_size or a step's rows

    @property
    def exploring(self) -> bool:
        return self.trial is not None

    @property
    def first_micro_batch_size(self) -> int:
        return self.size

    def cut(self, batch, max_rows: int, agree=None, row_cap: int | None = None) -> RowCut | PackedRowCut:
        if self.row_tokens and batch.packed:
            return PackedRowCut(self, batch, agree, row_cap)
        return RowCut(self, batch.rows, max_rows, row_cap)

    def next_size(self, remaining: int) -> int:
        if self.trial is not None and remaining >= self.trial:
            return self.trial
        return even_chunk(remaining, self.size)

    def needs_timing(self, size: int) -> bool:
        return self.trial is not None and size == self.trial

    def record(self, size: int, seconds: float, tokens: float, peak_bytes: float | None = None) -> None:
        self._measured(tokens, peak_bytes)
        if not self.needs_timing(size) or seconds <= 0:
            return
        self.throughput[size] = max(self.throughput.get(size, 0.0), tokens / seconds)
        self.trial_left -= 1
        if self.trial_left == 0 or self._clearly_faster(size):
            self._decide(size, tokens / size)

    def on_out_of_memory(self, size: int, padded_tokens: int | None = None) -> None:
        """A micro-batch of `size` ran out of memory: a trial never runs again, a size that had run halves."""
        self._out_of_memory(size)
        if size > self.size:  # a trial above the last size known to run: go back to it
            self._settle(f"{size} ran out of memory")
        else:
            self._shrink(size, f"{size} ran out of memory")

    def end_step(self, memory: StepMemory) -> str | None:
        return self._after_step(memory, memory.largest, memory.tokens / max(1, self.size))

    def retry_message(self, rows: int, padded_tokens: int | None) -> str:
        return f"Out of memory at micro-batch {rows}; running the step again at {self.size}."

    def _thrashed(self, memory: StepMemory) -> str:
        size = min(memory.largest, self.size)
        self.oom_sizes.append(size)
        self._shrink(size, f"{size} made the allocator free its cache to retry (allocator thrash)")
        return f"Allocator thrash at micro-batch {size}: the next steps run at {self.size}."

    def _grow_back(self, size: int) -> str:
        self.size = size
        if not self.auto:
            self.settled_because = FIXED
        return f"micro-batch {size}"

    def _shrink(self, size: int, because: str) -> None:
        self.size = size // 2
        self._settle(because)
        self._failed(size, had_run=size <= self.largest_run)

    def _decide(self, trial: int, tokens_per_row: float) -> None:
        previous = self.size if self.size != trial else None
        if previous is not None and self.throughput[trial] < self.throughput[previous] * (
            1 + self.growth_margin
        ):
            if trial > previous > 1 and len(self.throughput) == 2:
                # the first doubling did not pay: a smaller size may be faster (packed rows under sdpa, whose mask
                # is quadratic in a micro-batch's tokens), so halve while that pays
                self.trial, self.trial_left = previous // 2, REPEATS
                return
            self._settle(f"{trial} was less than {self.growth_margin:.0%} faster than {previous}")
            return
        self.size = trial
        if previous is not None and trial < previous:
            if trial > 1:
                self.trial, self.trial_left = trial // 2, REPEATS
            else:
                self._settle(f"1 was more than {self.growth_margin:.0%} faster than {previous}")
            return
        bigger = least(2 * trial, self.max_size, self.row_limit)
        if self.oom_sizes and bigger >= min(self.oom_sizes):
            self._settle(f"{min(self.oom_sizes)} ran out of memory")
        elif bigger <= trial:
            self._settle(self._limit_text(trial), by_limit=True)
        elif not self.fits(bigger * tokens_per_row):
            self._settle(f"{bigger} is predicted to exceed the memory limit")
        else:
            self.trial, self.trial_left = bigger, REPEATS

    def _clearly_faster(self, trial: int) -> bool:
        previous = self.throughput.get(self.size) if self.size != trial else None
        return previous is not None and self.throughput[trial] >= previous * (
            1 + DECISIVE * self.growth_margin
        )

    def _settle(self, because: str, by_limit: bool = False) -> None:
        self.trial, self.settled_because, self.stopped_by_limit = None, because, by_limit

    def _limit_text(self, size: int) -> str:
        if self.max_size is not None and size >= self.max_size:
            return f"it reached max_micro_batch_size={self.max_size}"
        return f"it reached the {self.row_limit} {self.unit} a step holds on a rank"

    def set_row_limit(self, row_limit: int) -> None:
        """A new plan's rows per rank: where they grew, a search or a fixed size the old limit held goes on growing."""
        old, self.row_limit = self.row_limit, row_limit
        if self.trial is not None or old is None or row_limit <= old:
            return
        fixed = self.settled_because == FIXED
        if not fixed and not self.stopped_by_limit:
            return
        bigger = least(self.start if fixed else 2 * self.size, row_limit, self.max_size)
        if bigger <= self.size or (self.oom_sizes and bigger >= min(self.oom_sizes)):
            return
        if fixed:
            self.size = bigger
        else:
            self.trial, self.trial_left, self.settled_because = bigger, REPEATS, None

    def larger_step_cap(self, last_micro_batch_size: int = 0, usual_micro_batches: int = 1) -> int | None:
        """The most rows a micro-batch of a larger step may hold: the size stated, or the one a search stopped at for
        memory or speed (`None`: as memory allows)."""
        if self.settled_because == FIXED:
            return least(self.start, self.max_size)
        if self.settled_because is not None and not self.stopped_by_limit:
            return self.size
        return self.max_size

    def limit_to(self, max_size: int | None) -> None:
        if max_size is None:
            return
        self.max_size, self.size = max_size, min(self.size, max_size)
        if self.trial is not None and self.trial > max_size:
            self._settle(f"max_micro_batch_size={max_size}")

    def check_longest_row(self, tokens: int | None) -> None:
        """Rows of any length run: one row is as small as a cut by rows goes."""

    def describe(self) -> str:
        if self.auto and self.exploring:
            text = (
                f"auto: starts at {self.size}, doubles while tokens/s gain > {self.growth_margin:.0%} (halves "
                "while it does where the first doubling does not)"
            )
        else:
            text = f"{self.size}" + ("" if self.auto else " (fixed)")
        if self.max_size:
            text += f", at most {self.max_size}"
        if self.row_tokens:
            text += (
                f" packed rows (a run of whole sequences of at most {self.row_tokens:,} tokens a row; the plain "
                "Trainer runs per_device_train_batch_size of them in one forward)"
            )
        return text + "; " + out_of_memory_text(self.oom_is_fatal, "shrinks and retries the step")

    def accumulation_text(self, per_rank_sizes: list[int], user_accumulation: int) -> str:
        if self.auto:
            return f"samples per rank per step / micro-batch (the user's: {user_accumulation})"
        counts = sorted({math.ceil(rows / self.size) for rows in per_rank_sizes})
        return " -> ".join(map(str, counts)) + f" micro-batches of at most {self.size}"

    def state_dict(self) -> dict:
        return {
            "size": self.size,
            "trial": self.trial,
            "trial_left": self.trial_left,
            "stopped_by_limit": self.stopped_by_limit,
            "throughput": {str(size): value for size, value in self.throughput.items()},
            **self._search_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.size = int(state["size"])
        self.trial = None if state["trial"] is None else int(state["trial"])
        self.trial_left = int(state["trial_left"])
        self.stopped_by_limit = bool(state["stopped_by_limit"])
        self.throughput = {int(size): float(value) for size, value in state["throughput"].items()}
        self._load_search_state(state)


class RowCut:
    """A step cut by rows, each micro-batch sized afresh after a timed one; every rank runs the same sizes."""

    def __init__(self, controller: RowController, rows: int, max_rows: int, row_cap: int | None = None):
        self.controller, self.rows, self.max_rows, self.row_cap = controller, rows, max_rows, row_cap

    def __iter__(self):
        start, remaining = 0, self.max_rows
        while remaining > 0:
            size = self.controller.next_size(remaining)
            if self.row_cap is not None and size > self.row_cap:  # (a trial size is then not timed this step)
                size = even_chunk(remaining, self.row_cap)
            own = max(0, min(size, self.rows - start))
            yield MicroBatch(start, own, size, self.controller.needs_timing(size), last=remaining <= size)
            start += own
            remaining -= size

    def record(self, micro: MicroBatch, report) -> None:
        if micro.timed:
            self.controller.record(micro.size, report.seconds, report.real_tokens, report.measured_peak)

    def failed_rows(self, micro: MicroBatch, report) -> int:
        return micro.size  # every rank runs the same sizes (packed: the same rows, other sequences)

    def finish(self, memory: StepMemory) -> str | None:
        return self.controller.end_step(memory)


class PackedRowCut(RowCut):
    """A step of packed rows cut into runs of whole sequences of at most `size x row_tokens` tokens (a trial's size
    for the first `trial_left`). Each rank cuts its own; all run as many, sized and timed alike by index."""

    def __init__(self, controller: RowController, batch, agree, row_cap: int | None = None):
        self.controller = controller
        self.trials = controller.trial_left if controller.trial is not None else 0
        lengths, row_tokens = batch.lengths_list, controller.row_tokens
        self.runs: list[tuple[int, int]] = []  # (first sequence, sequences)
        start = 0
        while start < len(lengths):
            budget = self._size(len(self.runs)) * row_tokens
            end, tokens = start + 1, lengths[start]
            while end < len(lengths) and tokens + lengths[end] <= budget:
                if row_cap is not None and end - start >= row_cap:
                    break
                tokens, end = tokens + lengths[end], end + 1
            self.runs.append((start, end - start))
            start = end
        (count,) = agree([len(self.runs)]) if agree is not None else (len(self.runs),)
        # decided now: a timed micro-batch may end the trial and change the controller's sizes mid-step
        self.sizes = [self._size(index) for index in range(int(count))]

    def _size(self, index: int) -> int:
        return self.controller.trial if index < self.trials else self.controller.size

    def __iter__(self):
        for index, size in enumerate(self.sizes):
            start, rows = self.runs[index] if index < len(self.runs) else (0, 0)
            yield MicroBatch(start, rows, size, index < self.trials, last=index == len(self.sizes) - 1)
