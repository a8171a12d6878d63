"""Choosing the effective batch by goodput: measured speed times the statistical efficiency the noise scale predicts.

A step of B samples makes about as much progress as (B_noise + B0) / (B_noise + B) steps' worth of samples at a
small batch B0 would, per sample (McCandlish et al. 2018: the samples to a given loss grow as 1 + B / B_noise;
Pollux, Qiao et al. 2021, calls the ratio statistical efficiency). Goodput is samples per second times that
efficiency; a larger batch pays only where it buys more speed than it loses in efficiency:

    goodput(B) = B / T(B) x (B_noise + B0) / (B_noise + B)

[`NoiseScaleSchedule`] grows the effective batch to the next allowed size when the goodput there, with a lower
confidence bound of the noise scale (a batch is not grown on a noise scale that is merely noisy), beats the current
one by a stated margin. It only grows: the noise scale rises as the loss falls, and a batch that shrank again would
flap with the estimate's noise.

T(B), the seconds of one optimizer step, comes from [`StepTimeModel`]: steps are timed as they run and fitted by

    T = f + a x n + b x r

where r are a rank's rows in the step and n its micro-batches: f the per-step part (optimizer, logging), a the
fixed part of one micro-batch (launches, the optimizer-free cost that does not grow with rows), b the part per
row. Where the runs so far do not tell f apart, f = 0, which predicts the least gain from a larger batch.

Pure Python: no torch, no transformers.
"""

from __future__ import annotations

import math
import numbers
from collections import deque
from dataclasses import dataclass
from statistics import linear_regression, median

from .fit import plane
from .schedule import Progress, check_effective_batch_size

RECENT = 16  # step times kept per (rows, micro-batches): the median discards steps that also logged or saved


def goodput_gain(
    batch: int, seconds: float, candidate: int, candidate_seconds: float, noise_scale: float
) -> float:
    """goodput(candidate) / goodput(batch), each samples/s x statistical efficiency (the B0 of the module docstring
    cancels in the ratio)."""
    speed = (candidate / candidate_seconds) / (batch / seconds)
    if math.isinf(noise_scale):
        return speed
    return speed * (noise_scale + batch) / (noise_scale + candidate)


def statistical_efficiency(batch: int, start: int, noise_scale: float) -> float:
    """The progress per sample of a step of `batch` samples against one of `start`: (B_noise + B0) / (B_noise + B);
    1 with an infinite noise scale (every sample counts fully)."""
    if math.isinf(noise_scale):
        return 1.0
    return (noise_scale + start) / (noise_scale + batch)


class StepTimeModel:
    """Seconds per optimizer step as a function of a rank's rows and micro-batches (see the module docstring).

    `record(rows, micro_batches, seconds)` after every timed step; `predict(rows, micro_batches)` gives the fitted
    time, or `None` until two different (rows, micro-batches) have been timed `min_steps` times each.
    """

    def __init__(self, min_steps: int = 3):
        self.min_steps = min_steps
        self.times: dict[tuple[int, int], deque] = {}

    def record(self, rows: int, micro_batches: int, seconds: float) -> None:
        if rows > 0 and micro_batches > 0 and seconds > 0 and math.isfinite(seconds):
            self.times.setdefault((rows, micro_batches), deque(maxlen=RECENT)).append(float(seconds))

    def medians(self) -> dict[tuple[int, int], float]:
        """The median time of each (rows, micro-batches) timed at least `min_steps` times."""
        return {key: median(t) for key, t in self.times.items() if len(t) >= self.min_steps}

    def coefficients(self) -> tuple[float, float, float] | None:
        """(f, a, b) of T = f + a n + b r, least squares over the medians (f = 0 where they do not determine it, or
        any comes out negative); `None` when they determine neither a nor b."""
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
        """Whether steps of `rows` rows in `micro_batches` micro-batches have been timed `min_steps` times."""
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
    """What prices an optimizer step at another effective batch.

    Attributes:
        step_time: the step times measured so far.
        world_size: data-parallel processes (a step's rows on a rank are its samples / this).
        micro_batches: the micro-batches a step at the current size runs on a rank.
        micro_batch_cap: the most rows a micro-batch may hold (a fixed `micro_batch_size`, a size that ran out of
            memory less one, `max_micro_batch_size`); `None`: a larger step runs as few micro-batches as the
            current one (the micro-batch controller grows with the rows, if memory allows).
    """

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
    """An effective batch that grows when the measured goodput says it pays (see the module docstring).

    Args:
        start: the first effective batch, in samples.
        max_size: never larger than this (required: `None` is refused naming it).
        factor: each change multiplies the batch by this (2: doubling), then rounds down to a multiple of the world
            size (so every rank takes the same share); at most `max_size`.
        margin: the modelled goodput must improve by more than this share (0.05: 5%) to change.
        confidence_z: the noise scale used is its lower confidence bound at this many standard errors (1.645: 95%
            one-sided); 0 uses the estimate itself.
        min_samples_between_changes: at least this many samples between two changes, and before the first, so that
            the noise scale has been measured at the current batch. A change also waits until steps at the current
            batch have been timed (`StepTimeModel.min_steps` of them, outside the micro-batch search): a size
            predicted from smaller ones only, where a small model's step time hardly grows with its rows, made a
            larger size look free.
        measure_every: on a step that would be one micro-batch per rank on one process (where nothing measures the
            noise scale), every this-many-th step is cut into two, so that the noise scale is measured; the step
            time model learns the cost of the extra micro-batch from those same steps. 0 never cuts. No step is
            cut once no noise scale could make a change pay (`cut_every`): at `max_size`, or where the next size is
            not faster per sample by the margin even at an infinite noise scale.
        min_efficiency: for a finite budget (a dataset's epochs: "the same final quality, sooner"), grow only while
            the run's modelled sample-weighted statistical efficiency, with the rest of the budget at the larger
            size, stays at least this (0.9, the default: the run's samples teach at least 90% of what they would
            at `start`); `None`: goodput alone, for an open-ended budget (`max_steps` over a stream), where the
            bound has no budget to apply to anyway. The default is measured (`benchmarks/time_to_quality.py`,
            LoRA and full fine-tuning and from scratch): goodput alone ended 5.8-7.1% above the best fixed batch's
            final eval loss in each setup, 0.9 within 0.5%. The efficiency so far is logged as
            `adaptive_batch/statistical_efficiency`.

    Example:
        ```python
        # start at 32 samples a step and double while it pays, up to 512
        AdaptiveBatch(schedule=NoiseScaleSchedule(32, max_size=512), lr_scaling="sqrt")
        ```

    The schedule holds the changes made in a run (`changes`); AdaptiveBatch saves them in its checkpoints and plans a
    resumed run with them. Like any schedule it answers `schedule(progress)`: the size of the last change made at or
    before `progress.step`.
    """

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
        _check_real(
            min_samples_between_changes,
            "min_samples_between_changes",
            lambda x: x >= 0,
            f"a number of samples >= 0, e.g. {20 * self.start} (20 steps of the start)",
        )
        if (
            isinstance(measure_every, bool)
            or not isinstance(measure_every, numbers.Integral)
            or measure_every < 0
        ):
            raise ValueError(
                f"NoiseScaleSchedule measure_every={measure_every!r} must be an integer >= 0 (0: never cut a step "
                "in two to measure), e.g. 4."
            )
        if min_efficiency is not None:
            _check_real(
                min_efficiency, "min_efficiency", lambda x: 0 < x <= 1, "in (0, 1], e.g. 0.9, or None"
            )
        self.min_efficiency = None if min_efficiency is None else float(min_efficiency)
        self.factor = float(factor)
        self.margin = float(margin)
        self.confidence_z = float(confidence_z)
        self.min_samples_between_changes = min_samples_between_changes
        self.measure_every = int(measure_every)
        self.changes: list[Change] = []

    # -- a schedule ----------------------------------------------------------------------------------------------

    def __call__(self, progress: Progress) -> int:
        size = self.start
        for change in self.changes:
            if change.step <= progress.step:
                size = change.size
        return size

    def describe(self) -> str:
        bound = (
            "" if self.min_efficiency is None else f", the run's efficiency at least {self.min_efficiency:g}"
        )
        return (
            f"{self.start} growing by goodput up to {self.max_size} (x{self.factor:g}, margin {self.margin:.0%}, "
            f"noise scale's lower bound at z={self.confidence_z:g}{bound})"
        )

    def sizes(self, world_size: int) -> list[int]:
        """Every effective batch the schedule can reach, in order."""
        sizes = [self.start]
        while (bigger := self.next_size(sizes[-1], world_size)) is not None:
            sizes.append(bigger)
        return sizes

    def next_size(self, size: int, world_size: int) -> int | None:
        """The size a change from `size` goes to, or `None` at the maximum."""
        bigger = min(self.max_size, math.floor(size * self.factor)) // world_size * world_size
        return bigger if bigger > size else None

    # -- deciding ------------------------------------------------------------------------------------------------

    def propose(
        self,
        current: int,
        samples_seen: int,
        noise_scale: float | None,
        costs: StepCosts,
        budget: int | None = None,
    ) -> tuple[int, str] | None:
        """The size to change to from `current`, after `samples_seen` samples, and why; `None` to stay.

        Args:
            noise_scale: the noise scale's lower confidence bound, in samples (`None`: not measured yet).
            costs: what prices a step at the next size.
            budget: the run's samples in all, for `min_efficiency` (`None`: not bounded).
        """
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
        """The modelled sample-weighted statistical efficiency of the run's first `samples` samples: each stretch
        between changes at its size, with the noise scale its change was decided on (the start counts fully); with
        `then=(size, noise_scale)`, the samples from `samples` to `budget` at that size too.

        Example: 1,000 samples at the start 32, then 1,000 at 64 decided on a noise scale of 32, whose samples
        count (32 + 32) / (32 + 64) = 2/3: 0.833."""
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
        """Every how many steps one process cuts a step of one micro-batch in two to measure the noise scale at
        `current`: `measure_every`, or 0 (none) where no noise scale could
        make a change pay: at `max_size`, or where the next size's modelled speed alone (as with an infinite noise
        scale) does not beat the current one's by the margin. (Spacing the cuts by their measured cost loses
        more than it saves: benchmarks/README.md.)"""
        if not self.measure_every or self.next_size(current, costs.world_size) is None:
            return 0
        modelled = self._modelled(current, costs)
        if modelled is not None:
            candidate, seconds, seconds_next = modelled
            if goodput_gain(current, seconds, candidate, seconds_next, math.inf) <= 1 + self.margin:
                return 0
        return self.measure_every

    def _modelled(self, current: int, costs: StepCosts) -> tuple[int, float, float] | None:
        """(the next size, the modelled seconds of a step at `current` and at it), or `None` (at the maximum, or
        not yet modelled)."""
        candidate = self.next_size(current, costs.world_size)
        if candidate is None:
            return None
        rows, rows_next = current // costs.world_size, candidate // costs.world_size
        micro_batches, cap = costs.micro_batches, costs.micro_batch_cap
        micro_next = micro_batches if cap is None else max(micro_batches, -(-rows_next // cap))
        seconds = costs.step_time.predict(rows, micro_batches)
        seconds_next = costs.step_time.predict(rows_next, micro_next)
        if seconds is None or seconds_next is None:
            return None
        return candidate, seconds, seconds_next

    def change(
        self, step: int, size: int, samples_seen: int, reason: str, noise_scale: float | None = None
    ) -> Change:
        """Record a change to `size` from `step` on (the step after the last one whose samples are already drawn),
        with the noise scale's estimate then (`None`: not measured)."""
        if self.changes and step <= self.changes[-1].step:
            raise ValueError(
                f"A change at step {step} comes before the last one, at {self.changes[-1].step}."
            )
        change = Change(step, size, samples_seen, reason, math.inf if noise_scale is None else noise_scale)
        self.changes.append(change)
        return change

    def noise_scale_at(self, step: int) -> float:
        """The noise scale the size of `step` was decided on: that of the last change at or before it (`inf` before
        the first)."""
        noise_scale = math.inf
        for change in self.changes:
            if change.step <= step:
                noise_scale = change.noise_scale
        return noise_scale

    # -- checkpoint ----------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the changes (a new run)."""
        self.changes = []

    def state_dict(self) -> dict:
        return {
            "changes": [
                [
                    c.step,
                    c.size,
                    c.samples_seen,
                    c.reason,
                    None if math.isinf(c.noise_scale) else c.noise_scale,
                ]
                for c in self.changes
            ]
        }

    def load_state_dict(self, state: dict) -> None:
        # (a checkpoint from before the noise scale was kept holds four fields: the gain rules then read infinity)
        self.changes = [
            Change(
                int(s), int(b), int(n), str(r), math.inf if not rest or rest[0] is None else float(rest[0])
            )
            for s, b, n, r, *rest in state["changes"]
        ]


def _check_real(value, name: str, ok, rule: str) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or not ok(value)
    ):
        raise ValueError(f"NoiseScaleSchedule {name}={value!r} must be {rule}.")


def _positive_int(value) -> bool:
    """A positive whole number of samples (an integral float too, as any schedule's size)."""
    try:
        check_effective_batch_size(value, where="")
    except ValueError:
        return False
    return True
