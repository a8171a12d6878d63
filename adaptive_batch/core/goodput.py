"""The effective batch grown where goodput (Pollux, Qiao et al. 2021) pays ([`NoiseScaleSchedule`]), on step times
fitted by [`StepTimeModel`]. See docs/how-it-works.md, "An effective batch chosen by goodput". Pure Python."""

from __future__ import annotations

import math
import numbers
from collections import deque
from dataclasses import dataclass
from statistics import linear_regression, median

from .fit import plane
from .schedule import Progress, finite_number

RECENT = 16  # step times kept per (rows, micro-batches): the median discards steps that also logged or saved


def goodput_gain(
    batch: int, seconds: float, candidate: int, candidate_seconds: float, noise_scale: float
) -> float:
    """goodput(candidate) / goodput(batch) (B0 cancels in the ratio)."""
    speed = (candidate / candidate_seconds) / (batch / seconds)
    return speed if math.isinf(noise_scale) else speed * (noise_scale + batch) / (noise_scale + candidate)


def statistical_efficiency(batch: int, start: int, noise_scale: float) -> float:
    """The progress per sample at `batch` against `start`: (B_noise + B0) / (B_noise + B), 1 at infinite noise."""
    return 1.0 if math.isinf(noise_scale) else (noise_scale + start) / (noise_scale + batch)


class StepTimeModel:
    """Seconds per optimizer step, T = f + a n + b r over a rank's rows r and micro-batches n (f = 0 until the runs
    tell it apart, which predicts the least gain); `predict` is `None` until two shapes are timed `min_steps` times."""

    def __init__(self, min_steps: int = 3):
        self.min_steps = min_steps
        self.times: dict[tuple[int, int], deque] = {}

    def record(self, rows: int, micro_batches: int, seconds: float) -> None:
        if rows > 0 and micro_batches > 0 and seconds > 0 and math.isfinite(seconds):
            self.times.setdefault((rows, micro_batches), deque(maxlen=RECENT)).append(float(seconds))

    def medians(self) -> dict[tuple[int, int], float]:
        return {key: median(t) for key, t in self.times.items() if len(t) >= self.min_steps}

    def coefficients(self) -> tuple[float, float, float] | None:
        """(f, a, b) by least squares over the medians (f = 0 where undetermined or any is negative), or `None`."""
        points = [(n, r, t) for (r, n), t in self.medians().items()]
        solved = plane(points)
        if solved is not None and min(solved) >= 0:
            return solved
        solved = plane(points, through_origin=True)
        if solved is None:
            return None
        _, a, b = solved
        if a < 0 or b < 0:  # one of them explains nothing: the other alone, through the origin
            index = 1 if a < 0 else 0
            times = [point[2] for point in points]
            slope = linear_regression([point[index] for point in points], times, proportional=True).slope
            a, b = (0.0, slope) if a < 0 else (slope, 0.0)
        return 0.0, a, b

    def measured(self, rows: int, micro_batches: int) -> bool:
        return len(self.times.get((rows, micro_batches), ())) >= self.min_steps

    def predict(self, rows: int, micro_batches: int) -> float | None:
        coefficients = self.coefficients()
        if coefficients is None:
            return None
        f, a, b = coefficients
        seconds = f + a * micro_batches + b * rows
        return seconds if seconds > 0 else None

    def state_dict(self) -> dict:
        return {"times": [[r, n, list(t)] for (r, n), t in self.times.items()]}

    def load_state_dict(self, state: dict) -> None:
        self.times = {
            (int(r), int(n)): deque((float(x) for x in t), maxlen=RECENT) for r, n, t in state["times"]
        }


@dataclass(frozen=True)
class StepCosts:
    """What prices a step at another effective batch (`micro_batch_cap` `None`: as few micro-batches at any size)."""

    step_time: StepTimeModel
    world_size: int = 1
    micro_batches: int = 1
    micro_batch_cap: int | None = None


@dataclass(frozen=True)
class Change:
    """The effective batch became `size` from optimizer step `step` on, decided after `samples_seen` samples, when
    the noise scale's estimate was `noise_scale` samples (what the gain LR rules read; `inf` if not measured)."""

    step: int
    size: int
    samples_seen: int
    reason: str
    noise_scale: float = math.inf


class NoiseScaleSchedule:
    """An effective batch that grows by `factor` from `start` up to `max_size` while the modelled goodput gains more
    than `margin`; each setting is explained in docs/how-it-works.md, "An effective batch chosen by goodput"."""

    def __init__(
        self,
        start: int,
        max_size: int | None = None,
        factor: float = 2.0,
        margin: float = 0.05,
        confidence_z: float = 1.645,
        min_samples_between_changes: int | None = None,
        measure_every: int = 4,
        min_efficiency: float | None = 0.9,
    ):
        example = "e.g. NoiseScaleSchedule(32, max_size=512): start at 32 samples a step, grow up to 512"
        if not _positive_int(start):
            raise ValueError(
                f"NoiseScaleSchedule start={start!r} is not a positive int: it is the first effective batch, in "
                f"samples per optimizer step (all GPUs), and it needs max_size, the largest it may grow to; {example}."
            )
        if max_size is None:
            raise TypeError(
                f"NoiseScaleSchedule({start}) needs max_size, the largest effective batch it may grow to (at most the "
                f"dataset's size); e.g. NoiseScaleSchedule({start}, max_size={16 * start})."
            )
        if not _positive_int(max_size):
            raise ValueError(
                f"NoiseScaleSchedule max_size={max_size!r} is not a positive int: it is the largest effective batch "
                f"the schedule may grow to, in samples; e.g. NoiseScaleSchedule({start}, max_size={16 * start})."
            )
        self.start, self.max_size = int(start), int(max_size)  # (32.0 is 32)
        if self.max_size < self.start:
            raise ValueError(
                f"NoiseScaleSchedule max_size={max_size} is below start={start}; it only grows the batch, so use "
                f"max_size >= {start}, e.g. max_size={16 * self.start}."
            )
        _check_real(factor, "factor", lambda x: x > 1, "greater than 1, e.g. 2 (doubling)")
        _check_real(margin, "margin", lambda x: 0 <= x < 1, "in [0, 1), e.g. 0.05 for 5%")
        _check_real(confidence_z, "confidence_z", lambda x: x >= 0, "at least 0, e.g. 1.645 (95% one-sided)")
        if min_samples_between_changes is None:
            min_samples_between_changes = 20 * self.start
        rule = f"a number of samples >= 0, e.g. {20 * self.start} (20 steps of the start)"
        _check_real(min_samples_between_changes, "min_samples_between_changes", lambda x: x >= 0, rule)
        rule = "an integer >= 0 (0: never cut a step in two to measure), e.g. 4"
        _check_real(
            measure_every, "measure_every", lambda x: isinstance(x, numbers.Integral) and x >= 0, rule
        )
        rule = "in (0, 1], e.g. 0.9, or None"
        if min_efficiency is not None:
            _check_real(min_efficiency, "min_efficiency", lambda x: 0 < x <= 1, rule)
        self.min_efficiency = None if min_efficiency is None else float(min_efficiency)
        self.factor, self.margin, self.confidence_z = float(factor), float(margin), float(confidence_z)
        self.min_samples_between_changes = min_samples_between_changes
        self.measure_every = int(measure_every)
        self.changes: list[Change] = []

    def __call__(self, progress: Progress) -> int:
        last = self._last_change(progress.step)
        return self.start if last is None else last.size

    def _last_change(self, step: int) -> Change | None:
        return next((change for change in reversed(self.changes) if change.step <= step), None)

    def describe(self) -> str:
        bound = f", the run's efficiency at least {self.min_efficiency:g}" if self.min_efficiency else ""
        return (
            f"{self.start} growing by goodput up to {self.max_size} (x{self.factor:g}, margin {self.margin:.0%}, "
            f"noise scale's lower bound at z={self.confidence_z:g}{bound})"
        )

    def sizes(self, world_size: int) -> list[int]:
        sizes = [self.start]
        while (bigger := self.next_size(sizes[-1], world_size)) is not None:
            sizes.append(bigger)
        return sizes

    def next_size(self, size: int, world_size: int) -> int | None:
        bigger = min(self.max_size, math.floor(size * self.factor)) // world_size * world_size
        return bigger if bigger > size else None

    def propose(
        self,
        current: int,
        samples_seen: int,
        noise_scale: float | None,
        costs: StepCosts,
        budget: int | None = None,
    ) -> tuple[int, str] | None:
        """The size to change to from `current` and why, or `None`; `noise_scale`: the noise scale's lower bound."""
        since = samples_seen - (self.changes[-1].samples_seen if self.changes else 0)
        if since < self.min_samples_between_changes or noise_scale is None:
            return None
        if not costs.step_time.measured(current // costs.world_size, costs.micro_batches):
            return None  # the current size's steps timed, not extrapolated from smaller ones
        modelled = self._modelled(current, costs)
        if modelled is None:
            return None
        candidate, seconds, seconds_next = modelled
        gain = goodput_gain(current, seconds, candidate, seconds_next, noise_scale)
        if gain <= 1 + self.margin:
            return None
        bounded = ""
        if self.min_efficiency is not None and budget is not None and budget > samples_seen:
            projected = self.run_efficiency(samples_seen, then=(candidate, noise_scale), budget=budget)
            if projected < self.min_efficiency:
                return None
            bounded = f"; the run's efficiency {projected:.3f} with the rest at {candidate}"
        reason = (
            f"goodput x{gain:.3f} at {candidate} (noise scale >= {noise_scale:,.0f} samples; a step modelled at "
            f"{seconds:.3g} s at {current}, {seconds_next:.3g} s at {candidate}{bounded})"
        )
        return candidate, reason

    def run_efficiency(
        self, samples: float, then: tuple[int, float] | None = None, budget: float | None = None
    ) -> float:
        """The modelled sample-weighted statistical efficiency of the first `samples` samples, each stretch at its size
        and noise scale; with `then=(size, noise_scale)`, the samples up to `budget` at that size too."""
        total, since, size, noise = 0.0, 0.0, self.start, math.inf
        for change in self.changes:
            if change.samples_seen >= samples:
                break
            total += (change.samples_seen - since) * statistical_efficiency(size, self.start, noise)
            since, size, noise = change.samples_seen, change.size, change.noise_scale
        total += (samples - since) * statistical_efficiency(size, self.start, noise)
        if then is not None and budget is not None:
            total += (budget - samples) * statistical_efficiency(then[0], self.start, then[1])
            samples = budget
        return total / samples if samples > 0 else 1.0

    def cut_every(self, current: int, costs: StepCosts) -> int:
        """Every how many steps one process cuts a step in two to measure the noise scale: `measure_every`, or 0 where
        no noise scale could make a change pay (at `max_size`, or the next size's speed alone misses the margin)."""
        if not self.measure_every or self.next_size(current, costs.world_size) is None:
            return 0
        modelled = self._modelled(current, costs)
        if modelled is not None:
            candidate, seconds, seconds_next = modelled
            if goodput_gain(current, seconds, candidate, seconds_next, math.inf) <= 1 + self.margin:
                return 0
        return self.measure_every

    def _modelled(self, current: int, costs: StepCosts) -> tuple[int, float, float] | None:
        """(the next size, the modelled seconds of a step at `current` and at it), or `None`."""
        candidate = self.next_size(current, costs.world_size)
        if candidate is None:
            return None
        rows, rows_next = current // costs.world_size, candidate // costs.world_size
        micro_batches, cap = costs.micro_batches, costs.micro_batch_cap
        micro_next = micro_batches if cap is None else max(micro_batches, -(-rows_next // cap))
        seconds = costs.step_time.predict(rows, micro_batches)
        seconds_next = costs.step_time.predict(rows_next, micro_next)
        return None if seconds is None or seconds_next is None else (candidate, seconds, seconds_next)

    def change(
        self, step: int, size: int, samples_seen: int, reason: str, noise_scale: float | None = None
    ) -> Change:
        if self.changes and step <= self.changes[-1].step:
            raise ValueError(
                f"A change at step {step} comes before the last one, at {self.changes[-1].step}."
            )
        change = Change(step, size, samples_seen, reason, math.inf if noise_scale is None else noise_scale)
        self.changes.append(change)
        return change

    def noise_scale_at(self, step: int) -> float:
        last = self._last_change(step)
        return math.inf if last is None else last.noise_scale

    def reset(self) -> None:
        self.changes = []

    def state_dict(self) -> dict:
        noise = [None if math.isinf(c.noise_scale) else c.noise_scale for c in self.changes]
        changes = [[c.step, c.size, c.samples_seen, c.reason, n] for c, n in zip(self.changes, noise)]
        return {"changes": changes}

    def load_state_dict(self, state: dict) -> None:
        # (a checkpoint from before the noise scale was kept holds four fields: the gain rules then read infinity)
        self.changes = [
            Change(
                int(s), int(b), int(n), str(r), math.inf if not rest or rest[0] is None else float(rest[0])
            )
            for s, b, n, r, *rest in state["changes"]
        ]


def _check_real(value, name: str, ok, rule: str) -> None:
    if not (finite_number(value) and ok(value)):
        raise ValueError(f"NoiseScaleSchedule {name}={value!r} must be {rule}.")


def _positive_int(value) -> bool:
    return finite_number(value) and float(value).is_integer() and value >= 1  # (32.0 is 32)
