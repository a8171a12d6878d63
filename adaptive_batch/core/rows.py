"""The micro-batch policy: how many samples go through one forward/backward, decided by memory and speed.

Order within an optimizer step does not change its gradient, so the step batch may be cut into micro-batches of
any sizes. The controller starts from the user's per-device batch and, with `auto`, grows it by doubling while
tokens per second improve by more than `growth_margin` (1%: on an H200, QLoRA 7B, 8 -> 16 -> 32 -> 64 samples
gain a few percent each). Where the first doubling does not pay, it halves instead while that pays (on packed rows
under sdpa, whose mask is quadratic in a micro-batch's tokens, 2 rows of 2,048 tokens ran 2.3x faster than 16).
It measures *inside* steps: a trial size runs up to `repeats` micro-batches of that size and is timed, while the
rest of the step uses the best size known so far, so finding the size costs about one step, not one step per size. An out-of-memory error halves the size and runs the step again from its first micro-batch;
a size that had run is tried again a step later (see `RowController`), a trial size that failed never again.

Its unit is rows: the samples of a step, or the sequences of a padding-free one. Cutting by padded tokens instead
(rows of varying length) is [`tokens.TokenController`]; both follow [`microbatch.CutController`].

Pure Python: no torch, no transformers.
"""

from __future__ import annotations

import math

from .fit import predict_peak
from .microbatch import MicroBatch, MicroBatchTooLargeError, StepMemory


def even_chunk(remaining: int, size: int) -> int:
    """Size of the next micro-batch when `remaining` rows are cut into as few near-equal chunks of at most `size`.

    Example: 10 rows at size 4 give 4, 3, 3 (not 4, 4, 2): the same number of micro-batches, a lower peak.
    """
    chunks = math.ceil(remaining / size)
    return math.ceil(remaining / chunks)


DECISIVE = 5  # a gain of this many margins needs no second measurement
FIXED = "fixed by micro_batch_size"
REGROW_AFTER_STEPS = 1  # steps run at the halved size before the size that ran out of memory is tried again
# steps failed at a size (out of memory, or allocator thrash) after which it is not tried again
MAX_FAILURES = 2


class RowController:
    """Chooses the rows of every micro-batch (a [`microbatch.CutController`] whose unit is rows).

    Args:
        start: the first size to run (the user's per-device batch, or a probed one).
        auto: grow by doubling while it pays; if `False`, keep `start` and only shrink on out-of-memory.
        max_size: never use more samples per micro-batch than this.
        row_limit: the most rows a step ever holds on one rank (no point measuring beyond).
        growth_margin: the relative tokens/s gain a doubling must bring to be kept.
        repeats: micro-batches timed per trial size (the best of them counts, which discards warm-up stalls); a
            trial whose first one is already `DECISIVE` times the margin faster than the size before is kept at once.
        memory_limit: bytes a micro-batch's peak may reach; with two measured sizes a trial predicted to exceed it
            (peak memory is close to affine in tokens) is not run.
        oom_is_fatal: an out-of-memory error cannot be retried (several processes under FSDP2 or DeepSpeed): a
            trial runs only where memory predicts it fits even before two sizes are measured ([`predict_peak`]'s
            `cautious` bound), and not at all before one is.
        row_tokens: for packed rows (TRL's `packing=True`: each dataset row holds several sequences, and the
            collator flattens a step into one row of them), the tokens of one row (its `max_length`): a micro-batch
            of `size` rows is then a run of whole sequences of at most `size x row_tokens` tokens.

    After an out-of-memory error at a size that had run (a long step, a fragmented moment), the size halves and the
    step runs again; `REGROW_AFTER_STEPS` steps later the size that failed is tried again where the peaks measured
    since say it fits, until it has failed `MAX_FAILURES` times. A size that never ran a step to its end (a stated
    size too large from the start) is not tried again; where the retried step fails again lower, the size tried
    again is the one the step first failed at. Allocator thrash (the caching allocator freeing its
    cache to retry an allocation, seen at a step's end) steps down the same way, without running the step again.
    """

    def __init__(
        self,
        start: int,
        auto: bool = True,
        max_size: int | None = None,
        row_limit: int | None = None,
        growth_margin: float = 0.01,
        repeats: int = 2,
        memory_limit: float | None = None,
        oom_is_fatal: bool = False,
        row_tokens: int | None = None,
    ):
        limit = min(x for x in (max_size, row_limit) if x is not None) if (max_size or row_limit) else None
        self.auto = auto
        self.start = max(1, start)  # a fixed size held down by a step's rows comes back when steps grow
        self.size = max(1, min(start, limit) if limit else start)
        self.max_size = max_size
        self.row_limit = row_limit
        self.growth_margin = growth_margin
        self.repeats = repeats
        self.memory_limit = memory_limit
        self.oom_is_fatal = oom_is_fatal
        self.trial: int | None = self.size if auto else None
        self.trial_left = repeats
        self.settled_because = None if auto else FIXED
        self.throughput: dict[int, float] = {}
        self.memory_points: list[tuple[float, float]] = []  # (tokens in the micro-batch, peak bytes)
        self.oom_sizes: list[int] = []
        self.row_tokens = row_tokens
        self.unit = "packed rows" if row_tokens else "rows"
        self.stopped_by_limit = False  # the search stopped at max_micro_batch_size or a step's rows
        self.shrunk_from: int | None = None  # a size that ran, then ran out of memory: tried again later
        self.steps_since_shrink = 0
        self.largest_run = 0  # the largest micro-batch of a step that ran to its end
        self.tried_again: list[int] = []  # sizes tried again after they failed, once each time
        self.failed_this_step = False

    kind = "rows"
    max_tokens = None  # no token budget: the cut counts rows

    # -- what to run -------------------------------------------------------------------------------------------

    @property
    def exploring(self) -> bool:
        return self.trial is not None

    @property
    def first_micro_batch_size(self) -> int:
        return self.size

    def cut(self, batch, max_rows: int, agree=None, row_cap: int | None = None) -> RowCut | PackedRowCut:
        """The micro-batches of a step whose batch holds `batch.rows` rows on this rank and `max_rows` on the rank
        with most (every rank runs the same sizes), at most `row_cap` rows each (for this step only). A step of
        packed rows flattened into sequences is cut between them, each rank its own ([`PackedRowCut`])."""
        if self.row_tokens and batch.packed:
            return PackedRowCut(self, batch, agree, row_cap)
        return RowCut(self, batch.rows, max_rows, row_cap)

    def next_size(self, remaining: int) -> int:
        """Size of the next micro-batch of a step with `remaining` rows left (the most of any rank)."""
        if self.trial is not None and remaining >= self.trial:
            return self.trial
        return even_chunk(remaining, self.size)

    def needs_timing(self, size: int) -> bool:
        """Whether a micro-batch of `size` is a trial whose time and memory must be measured."""
        return self.trial is not None and size == self.trial

    # -- what happened -----------------------------------------------------------------------------------------

    def record(self, size: int, seconds: float, tokens: float, peak_bytes: float | None = None) -> None:
        """Feed the measured time, tokens and peak memory of a timed micro-batch of `size`."""
        if peak_bytes is not None:
            self.memory_points.append((float(tokens), float(peak_bytes)))
        if not self.needs_timing(size) or seconds <= 0:
            return
        self.throughput[size] = max(self.throughput.get(size, 0.0), tokens / seconds)
        self.trial_left -= 1
        if self.trial_left == 0 or self._clearly_faster(size):
            self._decide(size, tokens / size)

    def on_out_of_memory(self, size: int, padded_tokens: int | None = None) -> None:
        """A micro-batch of `size` ran out of memory: a trial never runs again, a size that had run halves (and is
        tried again later, see the class docstring); the step runs again.

        Raises:
            MicroBatchTooLargeError: if `size` is 1.
        """
        self.oom_sizes.append(size)
        if size == 1:
            raise MicroBatchTooLargeError(
                "one sample per micro-batch runs out of memory", list(self.oom_sizes)
            )
        if size > self.size:  # a trial above the last size known to run: go back to it
            self._settle(f"{size} ran out of memory")
        else:
            self._shrink(size, f"{size} ran out of memory")

    def end_step(self, memory: StepMemory) -> str | None:
        """A step ran to its end, with `memory` measured over it; returns a line to log where the size changed
        (a step down for allocator thrash, or the size that ran out of memory tried again)."""
        if memory.peak_bytes is not None and memory.tokens > 0:
            self.memory_points.append((float(memory.tokens), float(memory.peak_bytes)))
        self.largest_run = max(self.largest_run, memory.largest)
        self.failed_this_step = False
        if memory.thrashed and memory.largest > 1 and self.trial is None:
            size = min(memory.largest, self.size)
            self.oom_sizes.append(size)
            self._shrink(size, f"{size} made the allocator free its cache to retry (allocator thrash)")
            return f"Allocator thrash at micro-batch {size}: the next steps run at {self.size}."
        if self.shrunk_from is None:
            return None
        self.steps_since_shrink += 1
        size, per_row = self.shrunk_from, memory.tokens / max(1, self.size)
        if self.steps_since_shrink < REGROW_AFTER_STEPS or not self._predicted_to_fit(size * per_row, True):
            return None
        self.size, self.shrunk_from = size, None
        self.tried_again.append(size)
        if not self.auto:
            self.settled_because = FIXED
        return tried_again_text(f"micro-batch {size}", self.tried_again.count(size))

    def retry_message(self, rows: int, padded_tokens: int | None) -> str:
        return f"Out of memory at micro-batch {rows}; running the step again at {self.size}."

    # -- decisions ---------------------------------------------------------------------------------------------

    def _shrink(self, size: int, because: str) -> None:
        """`size` failed: halve it; try it again later where a step had run it before (a size that never ran, such
        as a stated one too large from the start, is not tried again) unless it failed too often."""
        self.size = size // 2
        self._settle(because)
        # the step failed again, lower: the size tried again is the one it first failed at
        if self.failed_this_step:
            return
        self.failed_this_step = True
        again = size <= self.largest_run and self.tried_again.count(size) < MAX_FAILURES - 1
        self.shrunk_from = size if again else None
        self.steps_since_shrink = 0

    def _decide(self, trial: int, tokens_per_row: float) -> None:
        previous = self.size if self.size != trial else None
        if previous is not None and self.throughput[trial] < self.throughput[previous] * (
            1 + self.growth_margin
        ):
            if trial > previous > 1 and len(self.throughput) == 2:
                # the first doubling did not pay: a smaller size may be faster (packed rows under sdpa, whose mask
                # is quadratic in a micro-batch's tokens), so halve while that pays
                self.trial, self.trial_left = previous // 2, self.repeats
                return
            self._settle(f"{trial} was less than {self.growth_margin:.0%} faster than {previous}")
            return
        self.size = trial
        if previous is not None and trial < previous:
            if trial > 1:
                self.trial, self.trial_left = trial // 2, self.repeats
            else:
                self._settle(f"1 was more than {self.growth_margin:.0%} faster than {previous}")
            return
        bigger = 2 * trial
        if self.max_size is not None and bigger > self.max_size:
            bigger = self.max_size
        if self.row_limit is not None and bigger > self.row_limit:
            bigger = self.row_limit
        if self.oom_sizes and bigger >= min(self.oom_sizes):
            self._settle(f"{min(self.oom_sizes)} ran out of memory")
        elif bigger <= trial:
            self._settle(self._limit_text(trial), by_limit=True)
        elif not self._predicted_to_fit(bigger * tokens_per_row):
            self._settle(f"{bigger} is predicted to exceed the memory limit")
        else:
            self.trial, self.trial_left = bigger, self.repeats

    def _clearly_faster(self, trial: int) -> bool:
        previous = self.throughput.get(self.size) if self.size != trial else None
        return previous is not None and self.throughput[trial] >= previous * (
            1 + DECISIVE * self.growth_margin
        )

    def _settle(self, because: str, by_limit: bool = False) -> None:
        self.trial = None
        self.settled_because = because
        self.stopped_by_limit = by_limit

    def _limit_text(self, size: int) -> str:
        """Why the search stopped at `size`, naming the limit it reached."""
        if self.max_size is not None and size >= self.max_size:
            return f"it reached max_micro_batch_size={self.max_size}"
        return f"it reached the {self.row_limit} {self.unit} a step holds on a rank"

    def _predicted_to_fit(self, tokens: float, cautious: bool = False) -> bool:
        if self.memory_limit is None:
            return True
        cautious = cautious or self.oom_is_fatal
        return predict_peak(self.memory_points, tokens, cautious=cautious) <= self.memory_limit

    def set_row_limit(self, row_limit: int) -> None:
        """A step now holds up to `row_limit` rows on a rank (a new plan). Where the effective batch grew, a search
        that stopped at the old limit goes on doubling, and a fixed size that the old limit held down grows back
        towards the one stated."""
        old, self.row_limit = self.row_limit, row_limit
        if self.trial is not None or old is None or row_limit <= old:
            return
        fixed = self.settled_because == FIXED
        if not fixed and not self.stopped_by_limit:
            return
        bigger = min(self.start if fixed else 2 * self.size, row_limit, self.max_size or row_limit)
        if bigger <= self.size or (self.oom_sizes and bigger >= min(self.oom_sizes)):
            return
        if fixed:
            self.size = bigger
        else:
            self.trial, self.trial_left, self.settled_because = bigger, self.repeats, None

    def larger_step_cap(self, last_micro_batch_size: int = 0, usual_micro_batches: int = 1) -> int | None:
        """The most rows a micro-batch of a step larger than today's may hold, as far as known (`None`: as many as
        memory allows, the search going on): the size stated, or the one a search stopped at for memory or speed."""
        if (
            self.settled_because == FIXED
        ):  # (an out-of-memory error settles it otherwise: see `on_out_of_memory`)
            return self.start if self.max_size is None else min(self.start, self.max_size)
        if self.settled_because is not None and not self.stopped_by_limit:
            return self.size
        return self.max_size

    def limit_to(self, max_size: int | None) -> None:
        """Apply a `max_size` stated after the size was learned (a resumed run): never above it from now on."""
        if max_size is None:
            return
        self.max_size = max_size
        self.size = min(self.size, max_size)
        if self.trial is not None and self.trial > max_size:
            self._settle(f"max_micro_batch_size={max_size}")

    def check_longest_row(self, tokens: int | None) -> None:
        """Rows of any length run: a micro-batch of one row is as small as a cut by rows goes."""

    # -- the plan table ----------------------------------------------------------------------------------------

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

    # -- checkpoint --------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Plain JSON: what a resumed run needs to cut steps exactly as the uninterrupted run would."""
        return {
            "kind": self.kind,
            "size": self.size,
            "trial": self.trial,
            "trial_left": self.trial_left,
            "settled_because": self.settled_because,
            "stopped_by_limit": self.stopped_by_limit,
            "shrunk_from": self.shrunk_from,
            "steps_since_shrink": self.steps_since_shrink,
            "largest_run": self.largest_run,
            "tried_again": list(self.tried_again),
            "throughput": {str(size): value for size, value in self.throughput.items()},
            "memory_points": [list(point) for point in self.memory_points],
            "oom_sizes": list(self.oom_sizes),
        }

    def load_state_dict(self, state: dict) -> None:
        self.size = int(state["size"])
        self.trial = None if state["trial"] is None else int(state["trial"])
        self.trial_left = int(state["trial_left"])
        self.settled_because = state["settled_because"]
        self.stopped_by_limit = bool(state["stopped_by_limit"])
        self.shrunk_from = state["shrunk_from"]
        self.steps_since_shrink = int(state["steps_since_shrink"])
        self.largest_run = int(state["largest_run"])
        self.tried_again = [int(size) for size in state["tried_again"]]
        self.throughput = {int(size): float(value) for size, value in state["throughput"].items()}
        self.memory_points = [(float(t), float(p)) for t, p in state["memory_points"]]
        self.oom_sizes = [int(size) for size in state["oom_sizes"]]


class RowCut:
    """The micro-batches of one step cut by rows: the controller's size, decided afresh after each timed one (a trial
    that settles the search changes the size of the rest of the step). Every rank runs the same sizes; a rank with a
    row fewer runs its last micro-batch a row short, or a row that adds nothing."""

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
        """What a micro-batch measured (`report`: seconds, real tokens, peak bytes, all ranks combined)."""
        if micro.timed:
            self.controller.record(micro.size, report.seconds, report.real_tokens, report.measured_peak)

    def failed_rows(self, micro: MicroBatch, report) -> int:
        return micro.size  # every rank runs the same sizes: the size that failed somewhere

    def finish(self, memory: StepMemory) -> str | None:
        return self.controller.end_step(memory)


class PackedRowCut:
    """The micro-batches of one step of packed rows, flattened into sequences by the collator: runs of whole
    sequences (in their order) of at most `size x row_tokens` tokens each, `size` the controller's rows (a trial's
    for the step's first `trial_left` micro-batches, which are timed). Each rank cuts its own sequences; all run as
    many micro-batches, of the same sizes and timing by index (a rank with fewer runs a row that adds nothing), so
    that every rank feeds its controller the same."""

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

    def record(self, micro: MicroBatch, report) -> None:
        if micro.timed:
            self.controller.record(micro.size, report.seconds, report.real_tokens, report.measured_peak)

    def failed_rows(self, micro: MicroBatch, report) -> int:
        return micro.size  # the same on every rank, though their sequences differ

    def finish(self, memory: StepMemory) -> str | None:
        return self.controller.end_step(memory)


def out_of_memory_text(fatal: bool, retry: str) -> str:
    """What an out-of-memory error does, for the plan table."""
    if fatal:
        return (
            "an out-of-memory error cannot be retried under this engine and world size, so sizes grow only where "
            "measured peaks bound them below the limit"
        )
    return f"{retry} on out-of-memory"


def tried_again_text(what: str, times: int) -> str:
    """The line logged where a size or budget that failed is tried again (`times`: this is the n-th time)."""
    left = MAX_FAILURES - 1 - times
    return (
        f"Trying {what} again: its out-of-memory error (or allocator thrash) may have been one long step or a "
        f"fragmented moment; "
        + (
            f"it may fail {left} more time(s) before it stays below."
            if left
            else "if it fails again, it stays below."
        )
    )
