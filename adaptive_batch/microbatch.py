"""The micro-batch policy: how many samples go through one forward/backward, decided by memory and speed.

Order within an optimizer step does not change its gradient, so the step batch may be cut into micro-batches of
any sizes. The controller starts from the user's per-device batch and, with `auto`, grows it by doubling while
tokens per second improve by more than `growth_margin` (1%: on an H200, QLoRA 7B, 8 -> 16 -> 32 -> 64 samples
gain a few percent each). It measures *inside* steps: a trial size runs up to `repeats` micro-batches of that size
and is timed, while the rest of the step uses the best size known so far, so finding the size costs about one step,
not one step per size. An out-of-memory error caps the size for good and halves it; the
step is then run again from its first micro-batch.

With a token budget (`max_tokens`) each step's rows are cut by their lengths (`cut.py`) into micro-batches of at
most that many padded tokens, at the least modelled time: `overhead` x micro-batches + padded tokens. The overhead
(the fixed time of one micro-batch, in tokens' worth) is stated, or measured: the micro-batches of the first
`CALIBRATION_STEPS` steps after a warm-up step are timed and a line of time against padded tokens is fitted (its
intercept over its slope). With `tune_tokens` ("auto" on rows of varying length) the budget also grows: it doubles
after each step whose cut it constrained, while the peak memory measured against padded tokens predicts that the
doubled budget fits. An out-of-memory error halves the budget for good. Once measuring is over, the cut depends
only on the rows' lengths.

All decisions depend only on the measurements fed in and the rows left in the step, so ranks that are fed the same
(all-reduced) measurements make the same decisions and run the same number of micro-batches.

Pure Python: no torch, no transformers.
"""

from __future__ import annotations

import math

from .fit import affine


class MicroBatchTooLargeError(RuntimeError):
    """One sample per micro-batch still runs out of memory. `tried` holds the sizes that ran out, in order."""

    def __init__(self, message: str, tried: list[int]):
        super().__init__(message)
        self.tried = tried


def even_chunk(remaining: int, size: int) -> int:
    """Size of the next micro-batch when `remaining` rows are cut into as few near-equal chunks of at most `size`.

    Example: 10 rows at size 4 give 4, 3, 3 (not 4, 4, 2): the same number of micro-batches, a lower peak.
    """
    chunks = math.ceil(remaining / size)
    return math.ceil(remaining / chunks)


DECISIVE = 5  # a gain of this many margins needs no second measurement
CALIBRATION_STEPS = 3  # steps timed to measure the overhead of a micro-batch, after one warm-up step


class MicroBatchController:
    """Chooses the size of every micro-batch.

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
        max_tokens: cut steps by this many padded tokens per micro-batch instead; `start` (capped by `max_size`
            and `row_limit`) is then the most rows a micro-batch holds, and `auto` is ignored.
        tune_tokens: with `max_tokens`, grow the budget while the cut needs more and memory allows.
        overhead: with `max_tokens`, the fixed time of one micro-batch in padded tokens' worth; `None`: measured.
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
        max_tokens: int | None = None,
        tune_tokens: bool = False,
        overhead: int | None = None,
    ):
        limit = min(x for x in (max_size, row_limit) if x is not None) if (max_size or row_limit) else None
        self.size = max(1, min(start, limit) if limit else start)
        self.max_size = max_size
        self.row_limit = row_limit
        self.growth_margin = growth_margin
        self.repeats = repeats
        self.memory_limit = memory_limit
        self.max_tokens = max_tokens
        self.trial: int | None = self.size if auto and max_tokens is None else None
        self.trial_left = repeats
        by_tokens = max_tokens is not None
        self.tuning = by_tokens and tune_tokens
        self.overhead = overhead
        self.calibrating = by_tokens and overhead is None
        self.token_steps = 0  # steps cut by tokens while measuring
        self.time_points: list[tuple[float, float]] = []  # (padded tokens of a micro-batch, seconds)
        self.budget_because = "stated" if not self.tuning else None
        if by_tokens:
            self.settled_because = None if self.exploring else "cut by max_tokens_per_micro_batch"
        else:
            self.settled_because = None if auto else "fixed by micro_batch_size"
        self.throughput: dict[int, float] = {}
        self.memory_points: list[tuple[float, float]] = []  # (tokens in the micro-batch, peak bytes)
        self.oom_sizes: list[int] = []

    # -- what to run -------------------------------------------------------------------------------------------

    @property
    def exploring(self) -> bool:
        """Still measuring: a trial size, the overhead of a micro-batch, or the token budget."""
        return self.trial is not None or self.calibrating or self.tuning

    def token_overhead(self, longest: int) -> int | None:
        """The overhead a token cut uses now: stated or measured; while measuring, one longest row's worth (`longest`
        padded tokens); `None` (the fewest micro-batches) when the measurements gave no line."""
        if self.overhead is not None:
            return self.overhead
        return longest if self.calibrating else None

    def next_size(self, remaining: int) -> int:
        """Size of the next micro-batch of a step with `remaining` rows left (the most of any rank)."""
        if self.trial is not None and remaining >= self.trial:
            return self.trial
        return even_chunk(remaining, self.size)

    def needs_timing(self, size: int) -> bool:
        """Whether a micro-batch of `size` is a trial whose time and memory must be measured (with a token budget:
        every micro-batch while measuring)."""
        if self.max_tokens is not None:
            return self.calibrating or self.tuning
        return self.trial is not None and size == self.trial

    # -- what happened -----------------------------------------------------------------------------------------

    def record(self, size: int, seconds: float, tokens: float, peak_bytes: float | None = None) -> None:
        """Feed the measured time, tokens and peak memory of a timed micro-batch of `size` (with a token budget,
        `tokens` are its padded tokens)."""
        if self.max_tokens is not None:
            self._record_tokens(seconds, tokens, peak_bytes)
            return
        if peak_bytes is not None:
            self.memory_points.append((float(tokens), float(peak_bytes)))
        if not self.needs_timing(size) or seconds <= 0:
            return
        self.throughput[size] = max(self.throughput.get(size, 0.0), tokens / seconds)
        self.trial_left -= 1
        if self.trial_left == 0 or self._clearly_faster(size):
            self._decide(size, tokens / size)

    def on_out_of_memory(self, size: int, padded_tokens: int | None = None) -> None:
        """A micro-batch of `size` ran out of memory: never use `size` or more again, fall back, retry the step.

        With a token budget, the micro-batch held `padded_tokens`, and the budget becomes at most half of that.

        Raises:
            MicroBatchTooLargeError: if `size` is 1.
        """
        self.oom_sizes.append(size)
        if size == 1:
            raise MicroBatchTooLargeError(
                "one sample per micro-batch runs out of memory", list(self.oom_sizes)
            )
        if self.max_tokens is not None:
            self.max_tokens = max(1, min(self.max_tokens, padded_tokens // 2))
            if self.tuning:
                self._stop_tuning(f"{padded_tokens:,} padded tokens ran out of memory")
        elif size > self.size:  # a trial above the last size known to run: go back to it
            self._settle(f"{size} ran out of memory")
        else:
            self.size = size // 2
            self._settle(f"{size} ran out of memory")

    def end_token_step(self, bound: bool) -> None:
        """A step cut by tokens is done; `bound`: a doubled budget would have cut it otherwise (on some rank)."""
        if not (self.calibrating or self.tuning):
            return
        self.token_steps += 1
        cut_with_measured_overhead = not self.calibrating
        if self.calibrating and self.token_steps > CALIBRATION_STEPS:
            self.calibrating = False
            self.overhead = fitted_overhead(self.time_points)
        if self.tuning:
            bigger = 2 * self.max_tokens
            if not bound:
                if cut_with_measured_overhead:  # else the measured overhead may still ask for more
                    self._stop_tuning("a larger one would not change the cut")
            elif not self._predicted_to_fit(bigger):
                self._stop_tuning(f"{bigger:,} is predicted to exceed the memory limit")
            else:
                self.max_tokens = bigger
        if not self.exploring:
            overhead = (
                "fewest micro-batches" if self.overhead is None else f"overhead {self.overhead:,} tokens"
            )
            self.settled_because = f"token budget {self.max_tokens:,} ({self.budget_because}), {overhead}"

    def _record_tokens(self, seconds: float, padded_tokens: float, peak_bytes: float | None) -> None:
        if peak_bytes is not None:
            self.memory_points.append((float(padded_tokens), float(peak_bytes)))
        if self.calibrating and self.token_steps > 0 and seconds > 0:  # the first step warms up
            self.time_points.append((float(padded_tokens), seconds))

    def _stop_tuning(self, because: str) -> None:
        self.tuning = False
        self.budget_because = because

    # -- decisions ---------------------------------------------------------------------------------------------

    def _decide(self, trial: int, tokens_per_row: float) -> None:
        previous = self.size if self.size != trial else None
        if previous is not None and self.throughput[trial] < self.throughput[previous] * (
            1 + self.growth_margin
        ):
            self._settle(f"{trial} was less than {self.growth_margin:.0%} faster than {previous}")
            return
        self.size = trial
        bigger = 2 * trial
        if self.max_size is not None and bigger > self.max_size:
            bigger = self.max_size
        if self.row_limit is not None and bigger > self.row_limit:
            bigger = self.row_limit
        if self.oom_sizes and bigger >= min(self.oom_sizes):
            self._settle(f"{min(self.oom_sizes)} ran out of memory")
        elif bigger <= trial:
            self._settle("it reached max_micro_batch_size or the rows of a step")
        elif not self._predicted_to_fit(bigger * tokens_per_row):
            self._settle(f"{bigger} is predicted to exceed the memory limit")
        else:
            self.trial, self.trial_left = bigger, self.repeats

    def _clearly_faster(self, trial: int) -> bool:
        previous = self.throughput.get(self.size) if self.size != trial else None
        return previous is not None and self.throughput[trial] >= previous * (
            1 + DECISIVE * self.growth_margin
        )

    def _settle(self, because: str) -> None:
        self.trial = None
        self.settled_because = because

    def _predicted_to_fit(self, tokens: float) -> bool:
        if self.memory_limit is None:
            return True
        return predict_peak(self.memory_points, tokens) <= self.memory_limit

    def limit_to(self, max_size: int | None) -> None:
        """Apply a `max_size` stated after the size was learned (a resumed run): never above it from now on."""
        if max_size is None:
            return
        self.max_size = max_size
        self.size = min(self.size, max_size)
        if self.trial is not None and self.trial > max_size:
            self._settle(f"max_micro_batch_size={max_size}")

    # -- checkpoint --------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Plain JSON: what a resumed run needs to cut steps exactly as the uninterrupted run would."""
        return {
            "size": self.size,
            "trial": self.trial,
            "trial_left": self.trial_left,
            "settled_because": self.settled_because,
            "throughput": {str(size): value for size, value in self.throughput.items()},
            "memory_points": [list(point) for point in self.memory_points],
            "oom_sizes": list(self.oom_sizes),
            "max_tokens": self.max_tokens,
            "tuning": self.tuning,
            "budget_because": self.budget_because,
            "overhead": self.overhead,
            "calibrating": self.calibrating,
            "token_steps": self.token_steps,
            "time_points": [list(point) for point in self.time_points],
        }

    def load_state_dict(self, state: dict) -> None:
        self.size = int(state["size"])
        self.trial = None if state["trial"] is None else int(state["trial"])
        self.trial_left = int(state["trial_left"])
        self.settled_because = state["settled_because"]
        self.throughput = {int(size): float(value) for size, value in state["throughput"].items()}
        self.memory_points = [(float(t), float(p)) for t, p in state["memory_points"]]
        self.oom_sizes = [int(size) for size in state["oom_sizes"]]
        max_tokens = state.get("max_tokens")  # absent from checkpoints written before token budgets
        self.max_tokens = None if max_tokens is None else int(max_tokens)
        # absent from checkpoints written before the overhead was measured: the budget was cut for fewest
        self.tuning = bool(state.get("tuning", False))
        self.budget_because = state.get("budget_because", "stated")
        overhead = state.get("overhead")
        self.overhead = None if overhead is None else int(overhead)
        self.calibrating = bool(state.get("calibrating", False))
        self.token_steps = int(state.get("token_steps", 0))
        self.time_points = [(float(t), float(s)) for t, s in state.get("time_points", [])]


def fitted_overhead(points: list[tuple[float, float]]) -> int | None:
    """The fixed time of a micro-batch in tokens' worth: the intercept over the slope of the least-squares line of
    seconds against padded tokens (at least 0); `None` when the points give no rising line.

    Example: micro-batches of 1,000 and 3,000 tokens taking 0.2 s and 0.4 s: 0.1 s + 0.0001 s per token, so 1,000.
    """
    line = affine(points)
    if line is None or line[1] <= 0:
        return None
    intercept, slope = line
    return max(0, round(intercept / slope))


def predict_peak(points: list[tuple[float, float]], tokens: float) -> float:
    """Least-squares affine fit of peak bytes against tokens per micro-batch, evaluated at `tokens`.

    With fewer than two distinct token counts nothing can be predicted and 0 is returned (assume it fits).
    """
    line = affine(points)
    if line is None:
        return 0.0
    intercept, slope = line
    return intercept + slope * tokens
