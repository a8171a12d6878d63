"""The probe's search over a callable that runs trials: affine fits of peak memory and step time predict the largest
micro-batch that fits and the smallest near the best tokens/s (docs/how-it-works.md, "The commands")."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from ..core.fit import affine
from ..core.steps import nearest_multiples

TOLERANCE = 0.05  # the search's steps are at least this much larger than the largest size that fitted
FIRST_SIZES = (2, 4)  # tried before any prediction
MAX_TRIALS = 16
WITHIN = 0.02  # the recommendation: the smallest size within this share of the best tokens/s
GRANULE = 8  # the throughput trials' sizes are multiples of this (above 2 x it)


@dataclass(frozen=True)
class Trial:
    """One real training step at `size` samples (forward, backward, optimizer step), or its forward pass alone."""

    size: int
    out_of_memory: bool
    peak_bytes: float | None = None  # the peak the limit applies to (reserved on a GPU)
    peak_allocated_bytes: float | None = None
    seconds: float | None = None  # the step's time; for a stopped trial, the time until it stopped
    tokens: int = 0
    stopped: bool = False  # stopped as soon as its memory passed the limit: `peak_bytes` is a lower bound
    forward_seconds: float | None = None  # the forward pass's share of `seconds` (the loss computed)
    forward_only: bool = False  # only the forward ran: `seconds` is estimated, the peak is the forward's

    @property
    def tokens_per_second(self) -> float | None:
        timed = self.seconds and not self.out_of_memory and not self.stopped
        return self.tokens / self.seconds if timed else None

    @property
    def ran(self) -> bool:
        """Whether the step ran to the end, so that its peak memory and time are readings."""
        return not self.out_of_memory and not self.stopped and not self.forward_only

    def fits(self, limit: float | None) -> bool:
        return self.ran and (limit is None or self.peak_bytes is None or self.peak_bytes <= limit)

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second}


@dataclass
class Search:
    boundary: int
    first_failing: int | None
    predicted: int | None


def find_boundary(run: Callable[[int], Trial], limit: float | None, max_size: int) -> Search:
    """The largest size up to `max_size` whose trial fits under `limit` bytes; `ValueError` where 1 does not."""
    trials: list[Trial] = []
    largest_fitting, smallest_failing, predicted = 0, None, None

    def above(size: int) -> int:  # at least `TOLERANCE` above `size`
        return max(size + 1, math.ceil(size * (1 + TOLERANCE)))

    def attempt(size: int) -> bool:
        nonlocal largest_fitting, smallest_failing
        trial = run(size)
        trials.append(trial)
        if trial.fits(limit):
            largest_fitting = max(largest_fitting, size)
            return True
        smallest_failing = size if smallest_failing is None else min(smallest_failing, size)
        return False

    for size in FIRST_SIZES:
        if size > max_size or not attempt(size):
            break
    while len(trials) < MAX_TRIALS and largest_fitting < max_size:
        if smallest_failing is not None and (
            smallest_failing == 1 or largest_fitting > 0 and smallest_failing <= above(largest_fitting)
        ):
            break
        estimate = predict_boundary(trials, limit)
        if smallest_failing is None:  # growing: the prediction first, then steps of at least `TOLERANCE`
            if estimate is not None and estimate > largest_fitting and predicted is None:
                candidate = estimate  # the first prediction, however close
            elif estimate is None and (limit is None or not math.isfinite(limit)):
                candidate = 2 * max(largest_fitting, 1)  # no memory limit to aim at: double until it fails
            else:
                candidate = max(above(largest_fitting), estimate or 0)
            candidate = min(candidate, max_size)
        else:  # bracketed: the secant through the two largest readings, kept to the middle half of the bracket
            estimate = predict_boundary(trials, limit, secant=True)
            quarter = (smallest_failing - largest_fitting) // 4
            low, high = largest_fitting + max(1, quarter), smallest_failing - max(1, quarter)
            candidate = (largest_fitting + smallest_failing) // 2 if estimate is None else estimate
            candidate = min(max(candidate, low), high)
        if predicted is None:
            predicted = estimate
        attempt(candidate)
    if largest_fitting == 0:
        raise ValueError(
            "One sample per micro-batch does not fit"
            + (f" under the limit of {limit / 2**30:.3g} GiB" if limit else "")
            + ": enable gradient checkpointing, load the model in 4-bit, use an 8-bit or paged optimizer, or "
            "shorten the sequences."
        )
    return Search(largest_fitting, smallest_failing, predicted)


def predict_boundary(trials: list[Trial], limit: float | None, secant: bool = False) -> int | None:
    """The largest size an affine fit of peak bytes against size puts under `limit`, over every trial that ran
    (those over the limit included); with `secant`, the two largest only (near the boundary growth may be faster)."""
    points = sorted((t.size, t.peak_bytes) for t in trials if t.ran and t.peak_bytes is not None)
    if secant:
        points = points[-2:]
    line = affine(points)
    if limit is None or not math.isfinite(limit) or line is None or line[1] <= 0:
        return None
    intercept, slope = line
    return math.floor((limit - intercept) / slope)


def _timed_and_fitting(trials: list[Trial], limit: float | None) -> list[Trial]:
    """Trials with a tokens/s that fit: by their own reading, or, for a forward pass alone, by being no larger than a
    size whose whole step fitted."""
    largest = max((t.size for t in trials if t.fits(limit)), default=0)
    return [
        t
        for t in trials
        if t.tokens_per_second is not None and (t.fits(limit) or (t.forward_only and t.size <= largest))
    ]


def with_estimated_step(trial: Trial, trials: list[Trial], limit: float | None) -> Trial:
    """A forward-only `trial` with its step time estimated: its forward's time scaled by the ratio of step to
    forward time of the largest whole step that fits (`seconds` stays `None` without one)."""
    references = [t for t in trials if t.fits(limit) and t.seconds and t.forward_seconds]
    if not references or not trial.forward_seconds:
        return trial
    reference = max(references, key=lambda t: t.size)
    ratio = reference.seconds / reference.forward_seconds
    return replace(trial, seconds=trial.forward_seconds * ratio)


def recommend(trials: list[Trial], limit: float | None, within: float = WITHIN, largest: bool = False) -> int:
    """The smallest measured size within `within` of the best tokens/s, or the largest that fits with `largest`."""
    if largest:
        fitting = [t for t in trials if t.fits(limit) and t.tokens_per_second is not None]
    else:
        fitting = _timed_and_fitting(trials, limit)
    if not fitting:
        raise ValueError("No trial fitted, so there is nothing to recommend.")
    if largest:
        return max(t.size for t in fitting)
    best = max(t.tokens_per_second for t in fitting)
    return min(t.size for t in fitting if t.tokens_per_second >= best * (1 - within))


def next_throughput_size(trials: list[Trial], limit: float | None) -> int | None:
    """The next size to time so that [`recommend`] finds a small size within `WITHIN` of the best (`None` once one
    below the largest timed is): the fit's size for `WITHIN / 2`, else the gap's middle, rounded to `GRANULE`."""
    fitting = _timed_and_fitting(trials, limit)
    if not fitting:
        return None
    best = max(t.tokens_per_second for t in fitting)
    good = min(t.size for t in fitting if t.tokens_per_second >= best * (1 - WITHIN))
    if good < max(t.size for t in fitting):
        return None
    short = max((t.size for t in fitting if t.size < good), default=0)
    candidate = _predicted_within(trials, best * (1 - WITHIN / 2))
    if candidate is None or not short < candidate < good:
        candidate = (short + good) // 2
    if candidate >= 2 * GRANULE:
        candidate = round(candidate / GRANULE) * GRANULE
    if candidate >= good or candidate <= short or candidate in {t.size for t in trials}:
        return None
    return candidate


def _predicted_within(trials: list[Trial], target: float) -> int | None:
    """The smallest size an affine fit of step time puts at `target` tokens/s or more; `None` without a fit."""
    timed = [t for t in trials if t.tokens_per_second is not None]
    busy = [t for t in timed if t.size >= 4]
    points = busy if len({t.size for t in busy}) >= 2 else timed
    line = affine((t.size, t.seconds) for t in points)
    if line is None:
        return None
    fixed, slope = line
    tokens_per_sample = points[0].tokens / points[0].size
    # size x tokens_per_sample / (fixed + slope x size) >= target, solved for size
    denominator = tokens_per_sample - target * slope
    return max(1, math.ceil(target * fixed / denominator)) if denominator > 0 else None


def split_effective_batch(micro_batch_size: int, effective_batch_size: int, gpus: int) -> tuple[int, int]:
    """`(per_device_train_batch_size, gradient_accumulation_steps)` for the effective batch: the largest per-device
    size up to `micro_batch_size` that divides the per-GPU share, so that the effective batch is exact."""
    if effective_batch_size % gpus:
        raise ValueError(
            f"effective batch {effective_batch_size} is not divisible by {gpus} GPUs: every GPU must take the same "
            f"share. Use {nearest_multiples(effective_batch_size, gpus)}."
        )
    share = effective_batch_size // gpus
    per_device = max(d for d in range(1, min(micro_batch_size, share) + 1) if share % d == 0)
    return per_device, share // per_device


def split_reason(micro_batch_size: int, effective_batch_size: int, gpus: int) -> str | None:
    """Why [`split_effective_batch`] gives a per-device size below `micro_batch_size` (`None` where it does not)."""
    per_device, accumulation = split_effective_batch(micro_batch_size, effective_batch_size, gpus)
    if per_device >= micro_batch_size:
        return None
    share = effective_batch_size // gpus
    if share < micro_batch_size:
        return (
            f"{per_device} x {accumulation}: the {share} samples per device are fewer than the recommended "
            f"{micro_batch_size}"
        )
    return (
        f"{per_device} x {accumulation}: {per_device} is the largest size up to the recommended {micro_batch_size} "
        f"that divides the {share} samples per device evenly ({micro_batch_size} would leave a remainder of "
        f"{share % micro_batch_size})"
    )
