"""The micro-batch policy for rows of varying length: each step cut by padded tokens ([`cut.py`]) at the least
modelled time under a token budget (docs/how-it-works.md, "Variable-length data"). Pure Python."""

from __future__ import annotations

import logging

from .fit import robust_affine
from .microbatch import Agree, MicroBatch, MicroBatchSearch, StepMemory, least, out_of_memory_text

logger = logging.getLogger("adaptive_batch")

CALIBRATION_STEPS = 3  # steps timed to measure the overhead of a micro-batch, after one warm-up step
LINE_MARGIN = 0.15  # how much slower than the fitted line micro-batches beyond its range may run


class TokenController(MicroBatchSearch):
    """Cuts every step by padded tokens (a [`microbatch.CutController`] whose unit is padded tokens); `overhead`: a
    micro-batch's fixed time in padded tokens' worth (`None`: measured)."""

    kind = "tokens"
    unit = "padded tokens"
    largest_key = "tokens_run"

    def __init__(
        self,
        max_tokens: int,
        max_rows: int | None = None,
        row_limit: int | None = None,
        tune: bool = False,
        overhead: int | None = None,
        memory_limit: float | None = None,
        oom_is_fatal: bool = False,
    ):
        super().__init__(memory_limit, oom_is_fatal)
        self.max_tokens, self.max_rows, self.row_limit = max_tokens, max_rows, row_limit
        self.tuning, self.overhead = tune, overhead
        self.calibrating = self.measures_overhead = overhead is None  # a stated one is kept as stated
        self.no_line = False  # measured, but the times gave no rising line: one longest row's worth
        self.line_missed: float | None = None  # how much slower than the line a grown budget's last step ran
        self.steps_measured = 0
        self.time_points: list[tuple[float, float]] = []  # (padded tokens of a micro-batch, seconds)
        self.step_start = 0  # where this step's time points begin
        # padded tokens of the micro-batches that ran out of memory (or thrashed)
        self.failed_tokens: list[int] = []
        self.budget_because = None if tune else "stated"
        self.settled_because = None if self.exploring else "cut by max_tokens_per_micro_batch"
        self.warned_long_row = False

    @property
    def exploring(self) -> bool:
        return self.calibrating or self.tuning

    @property
    def first_micro_batch_size(self) -> None:
        return None  # decided by each step's lengths when it is cut

    def set_row_limit(self, rows: int) -> None:
        self.row_limit = rows

    def larger_step_cap(self, last_micro_batch_size: int, usual_micro_batches: int) -> int | None:
        """The largest micro-batch of the last step where steps are cut in several (the budget binds), else `None`."""
        return max(1, last_micro_batch_size) if usual_micro_batches > 1 else None

    def check_longest_row(self, tokens: int | None) -> None:
        if tokens is None or tokens <= self.max_tokens or self.warned_long_row:
            return
        self.warned_long_row = True
        logger.warning(
            f"A row of {tokens} tokens is longer than max_tokens_per_micro_batch={self.max_tokens}, so it runs "
            "alone in its micro-batch, above the budget (a row cannot be split). Raise max_tokens_per_micro_batch to "
            f"at least {tokens}, or lower max_length."
        )

    def cut(self, batch, max_rows: int, agree: Agree, row_cap: int | None = None) -> TokenCut:
        return TokenCut(self, batch, agree, row_cap)

    def token_overhead(self, longest: int) -> int:
        """The overhead a cut uses: stated or measured, else one longest row's worth."""
        return self.overhead if self.overhead is not None else longest

    def record(self, seconds: float, padded_tokens: float, peak_bytes: float | None = None) -> None:
        self._measured(padded_tokens, peak_bytes)
        # measured after the warm-up step
        if self.measures_overhead and self.exploring and self.steps_measured > 0 and seconds > 0:
            self.time_points.append((float(padded_tokens), seconds))

    def end_step(self, bound: bool, memory: StepMemory | None = None) -> str | None:
        """A step is done (`bound`: a doubled budget would have cut it otherwise); a line to log, or `None`."""
        notice = self._after_step(memory, memory.tokens, 1.0) if memory is not None else None
        if self.exploring:
            self._measure_step(bound)
        return notice

    def _thrashed(self, memory: StepMemory) -> str:
        self._shrink(memory.tokens)
        return (
            f"Allocator thrash at {memory.tokens:,} padded tokens: the next steps cut at {self.max_tokens:,}."
        )

    def _grow_back(self, budget: int) -> str:
        self.max_tokens = budget
        return f"the token budget of {budget:,}"

    def _shrink(self, failed: int) -> None:
        """Cut at most at half the smallest failed micro-batch from now on (retried later where one that size ran)."""
        self.failed_tokens.append(failed)
        previous = self.max_tokens
        self.max_tokens = max(1, min(self.max_tokens, min(self.failed_tokens) // 2))
        had_run = failed <= self.largest_run and previous > self.max_tokens
        self._failed(previous, had_run)

    def _measure_step(self, bound: bool) -> None:
        self.steps_measured += 1
        fitted_on, this_step = self.time_points[: self.step_start], self.time_points[self.step_start :]
        self.step_start = len(self.time_points)
        cut_with_measured_overhead = not self.calibrating
        if self.calibrating and self.steps_measured > CALIBRATION_STEPS:
            self.calibrating = False
            self._fit(self.time_points)
        elif self.measures_overhead and cut_with_measured_overhead:  # growing: keep the line where it held
            slower = slower_than_the_line(fitted_on, this_step)
            if slower is None:
                self.line_missed = None
                self._fit(self.time_points)
            elif self.line_missed is None:  # once may be a slow moment of the host: the same budget once more
                self.line_missed = slower
                del self.time_points[len(fitted_on) :]
                self.step_start = len(self.time_points)
                return
            else:  # twice: the line does not hold there
                largest = int(max(tokens for tokens, _ in fitted_on))
                self.max_tokens = min(self.max_tokens, largest)
                self._stop_tuning(
                    f"micro-batches above {largest:,} padded tokens ran {min(slower, self.line_missed):.0%} "
                    f"slower than the line measured up to there predicts, twice"
                )
        if self.tuning:
            bigger = 2 * self.max_tokens
            if not bound:
                if cut_with_measured_overhead:  # else the measured overhead may still ask for more
                    self._stop_tuning("a larger one would not change the cut")
            elif not self.fits(bigger):
                self._stop_tuning(f"{bigger:,} is predicted to exceed the memory limit")
            else:
                self.max_tokens = bigger
        if not self.exploring:
            if self.overhead == 0:
                overhead = (
                    "overhead 0 tokens (a micro-batch's time rose with its padded tokens alone, as on a CPU: rows "
                    "of different lengths then run in micro-batches of their own, down to one row, to save padding)"
                )
            elif self.overhead is not None:
                overhead = f"overhead {self.overhead:,} tokens"
            else:
                overhead = "overhead one longest row (the time of a micro-batch did not rise with its tokens)"
            self.settled_because = f"token budget {self.max_tokens:,} ({self.budget_because}), {overhead}"

    def on_out_of_memory(self, rows: int, padded_tokens: int) -> None:
        """The budget halves below `padded_tokens` and stops growing; [`MicroBatchTooLargeError`] if it was one row."""
        self._out_of_memory(rows)
        self._shrink(padded_tokens)
        if self.tuning:
            self._stop_tuning(f"{padded_tokens:,} padded tokens ran out of memory")

    def retry_message(self, rows: int, padded_tokens: int | None) -> str:
        return (
            f"Out of memory at a micro-batch of {rows} rows and {padded_tokens} padded tokens; running the step "
            f"again with max_tokens_per_micro_batch={self.max_tokens}."
        )

    def limit_to(self, max_size: int | None) -> None:
        self.max_rows = least(self.max_rows, max_size)

    def describe(self) -> str:
        text = f"cut by a token budget of {self.max_tokens:,} padded tokens (rows x padded length)"
        if self.tuning:
            text = (
                f"auto, rows of varying length: cut by padded tokens (rows x padded length), at the least time; "
                f"the budget starts at {self.max_tokens:,} and doubles while the cut needs more and memory allows"
            )
        if self.max_rows is not None and (self.row_limit is None or self.max_rows < self.row_limit):
            text += f", at most {self.max_rows} rows"
        return text + "; " + out_of_memory_text(self.oom_is_fatal, "the budget halves and the step retries")

    def accumulation_text(self, per_rank_sizes: list[int], user_accumulation: int) -> str:
        return f"as many as the rows' lengths need (the user's: {user_accumulation})"

    def _fit(self, points: list[tuple[float, float]]) -> None:
        self.overhead = fitted_overhead(points)
        self.no_line = self.overhead is None

    def _stop_tuning(self, because: str) -> None:
        self.tuning, self.budget_because = False, because

    def state_dict(self) -> dict:
        return {
            "max_tokens": self.max_tokens,
            "tuning": self.tuning,
            "budget_because": self.budget_because,
            "overhead": self.overhead,
            "calibrating": self.calibrating,
            "no_line": self.no_line,
            "line_missed": self.line_missed,
            "steps_measured": self.steps_measured,
            "time_points": [list(point) for point in self.time_points],
            "failed_tokens": list(self.failed_tokens),
            **self._search_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.max_tokens = int(state["max_tokens"])
        self.tuning = bool(state["tuning"])
        self.budget_because = state["budget_because"]
        self.overhead = None if state["overhead"] is None else int(state["overhead"])
        self.calibrating = bool(state["calibrating"])
        self.no_line = bool(state["no_line"])
        self.line_missed = state["line_missed"]
        self.steps_measured = int(state["steps_measured"])
        self.time_points = [(float(t), float(s)) for t, s in state["time_points"]]
        self.step_start = len(self.time_points)  # written at a step's end
        self.failed_tokens = [int(tokens) for tokens in state["failed_tokens"]]
        self._load_search_state(state)


class TokenCut:
    """A step cut by tokens before it runs, from this rank's row lengths; all ranks run as many micro-batches."""

    def __init__(self, controller: TokenController, batch, agree: Agree, row_cap: int | None = None):
        self.controller = controller
        # a row cap counts dataset rows, which a padding-free step no longer shows: the budget alone bounds it
        caps = (row_cap,) if batch.packed else (row_cap, controller.max_rows, controller.row_limit)
        budget, cap = controller.max_tokens, least(*caps)
        longest = batch.longest_row()
        overhead = controller.token_overhead(longest)
        self.sizes = batch.token_chunks(budget, cap, overhead)
        controller.check_longest_row(longest)
        # while the budget grows: would a doubled one cut this step otherwise?
        bound = controller.tuning and batch.token_chunks(2 * budget, cap, overhead) != self.sizes
        count, bound = agree([len(self.sizes), float(bound)])
        self.count, self.bound = int(count), bool(bound)

    def __iter__(self):
        start, timed = 0, self.controller.exploring
        for index in range(self.count):
            own = self.sizes[index] if index < len(self.sizes) else 0
            yield MicroBatch(start, own, own, timed, last=index == self.count - 1)
            start += own

    def record(self, micro: MicroBatch, report) -> None:
        if micro.timed:
            self.controller.record(report.seconds, report.padded_tokens, report.measured_peak)

    def failed_rows(self, micro: MicroBatch, report) -> int:
        return report.failed_rows  # the smallest micro-batch that ran out on any rank

    def finish(self, memory: StepMemory) -> str | None:
        return self.controller.end_step(self.bound, memory)


def fitted_overhead(points: list[tuple[float, float]]) -> int | None:
    """A micro-batch's fixed time in tokens' worth: intercept over slope of the robust line of seconds against padded
    tokens (at least 0); `None` where the points give no rising line."""
    line = robust_affine(points)
    if line is None or line[1] <= 0:
        return None
    intercept, slope = line
    return max(0, round(intercept / slope))


def slower_than_the_line(
    fitted_on: list[tuple[float, float]], new: list[tuple[float, float]]
) -> float | None:
    """How much slower than `fitted_on`'s line the `new` micro-batches beyond its range ran, above `LINE_MARGIN`."""
    line = robust_affine(fitted_on) if fitted_on else None
    if line is None or line[1] <= 0:
        return None
    largest = max(tokens for tokens, _ in fitted_on)
    beyond = [(tokens, seconds) for tokens, seconds in new if tokens > largest]
    if not beyond:
        return None
    predicted = sum(line[0] + line[1] * tokens for tokens, _ in beyond)
    slower = sum(seconds for _, seconds in beyond) / predicted - 1
    return slower if slower > LINE_MARGIN else None
