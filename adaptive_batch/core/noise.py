"""The gradient noise scale of McCandlish et al. (2018), measured from the micro-batches every step is cut into.

A step's gradient is the sum of its micro-batches' contributions, G_step = sum_j d_j. Micro-batch j holds n_j units
(label tokens, or rows for a loss averaged over rows) and weighs a_j in the step (a_j = n_j / N when the loss is
averaged over the step's N units): d_j = a_j g_j, where g_j is the mean gradient of its units. With per-unit
gradients of mean G and covariance Sigma, E|g_j|^2 = |G|^2 + tr(Sigma) / n_j, so the sums

    S_small = sum_j |d_j|^2 / a_j       (E = |G|^2 + tr(Sigma) A,   A = sum_j a_j / n_j)
    S_big   = |G_step|^2                (E = |G|^2 + tr(Sigma) B,   B = sum_j a_j^2 / n_j)

give unbiased estimates of both, for any sizes:

    tr(Sigma) = (S_small - S_big) / (A - B),    |G|^2 = (A S_big - B S_small) / (A - B).

With a_j = n_j / N (A = M / N, B = 1 / N, M micro-batches) these are the familiar
|G|^2 = (M S_big - S_small) / (M - 1) and tr(Sigma) = N (S_small - S_big) / (M - 1) ([`step_estimate`]). Every sum
runs over the micro-batches of all ranks, so under DDP each rank adds its own and one all-reduce combines them
([`MicroBatchSums`]).

One step's estimates are noisy (|G|^2 may even come out negative); [`NoiseScale`] smooths the numerator and the
denominator separately, with bias-corrected exponential moving averages whose time constant is counted in samples,
and divides them: an average of ratios would be biased. The noise scale B_simple = tr(Sigma) / |G|^2 is the batch
size (in samples) at which the gradient's noise and its signal are of the same size.

Pure Python: no torch, no transformers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields

SHARE_TOLERANCE = 1e-6  # the shares of a step's micro-batches add up to 1 within this (float rounding)
PRECONDITIONERS = (
    "none",
    "adam",
)  # what the gradients are measured as: raw, or divided by Adam's denominator


@dataclass(frozen=True)
class StepEstimate:
    """One step's unbiased estimates.

    Attributes:
        grad_norm_sq: |G|^2, the squared norm of the true (expected) gradient.
        grad_variance: tr(Sigma), the summed variance of the gradient of one sample (or of one unit, where no
            samples were given).
    """

    grad_norm_sq: float
    grad_variance: float

    @property
    def finite(self) -> bool:
        return math.isfinite(self.grad_norm_sq) and math.isfinite(self.grad_variance)


@dataclass
class MicroBatchSums:
    """What the estimator needs from a step's micro-batches, as sums (so ranks combine them with one SUM
    all-reduce: `to_list`, `from_list`).

    Attributes:
        small: S_small = sum_j |d_j|^2 / a_j.
        share_per_unit: A = sum_j a_j / n_j.
        share_sq_per_unit: B = sum_j a_j^2 / n_j.
        shares: sum_j a_j; 1 when every micro-batch of the step was counted.
        units: sum_j n_j, the units (label tokens or rows) of the step.
        count: M, the micro-batches.
    """

    small: float = 0.0
    share_per_unit: float = 0.0
    share_sq_per_unit: float = 0.0
    shares: float = 0.0
    units: float = 0.0
    count: float = 0.0

    def add(self, units: float, share: float, norm_sq: float) -> None:
        """Count one micro-batch of `units` units that weighs `share` in the step gradient, its contribution d_j
        having the squared norm `norm_sq`."""
        self.small += norm_sq / share
        self.share_per_unit += share / units
        self.share_sq_per_unit += share * share / units
        self.shares += share
        self.units += units
        self.count += 1

    @property
    def complete(self) -> bool:
        """The shares of the micro-batches counted add up to the whole step."""
        return abs(self.shares - 1.0) <= SHARE_TOLERANCE

    def estimate(self, step_norm_sq: float, samples: float | None = None) -> StepEstimate | None:
        """|G|^2 and tr(Sigma) from these sums and S_big = `step_norm_sq`; `None` with fewer than 2 micro-batches.

        tr(Sigma) is per unit, or per sample with `samples` (the samples of the step): the variance of a sample's
        gradient counts as that of `units / samples` units, tr(Sigma) x samples / units, which makes
        tr(Sigma) / |G|^2 a number of samples. (Exact when the samples hold equally many units.)
        """
        if self.count < 2:
            return None
        spread = self.share_per_unit - self.share_sq_per_unit  # A - B > 0: sum_j a_j (1 - a_j) / n_j
        grad_norm_sq = (self.share_per_unit * step_norm_sq - self.share_sq_per_unit * self.small) / spread
        variance = (self.small - step_norm_sq) / spread
        if samples is not None:
            variance *= samples / self.units
        return StepEstimate(grad_norm_sq, variance)

    def to_list(self) -> list[float]:
        return [getattr(self, f.name) for f in fields(self)]

    @classmethod
    def from_list(cls, values: Iterable[float]) -> MicroBatchSums:
        return cls(*values)


def step_estimate(
    micro_batches: Iterable[tuple[float, float]], step_norm_sq: float, total_units: float
) -> StepEstimate | None:
    """One step's |G|^2 and tr(Sigma) (per unit) from its micro-batches, each `(n_j, |d_j|^2)` where d_j is its
    contribution to the step gradient and the loss is averaged over the step's `total_units` units (a_j =
    n_j / N): |G|^2 = (M S_big - S_small) / (M - 1), tr(Sigma) = N (S_small - S_big) / (M - 1).

    Example: two micro-batches of 2 units each contributing d = (1, 0) and (0, 1), G_step = (1, 1):
        `step_estimate([(2, 1.0), (2, 1.0)], 2.0, 4)` gives |G|^2 = (2 x 2 - 4) / 1 = 0 and
        tr(Sigma) = 4 x (4 - 2) = 8.
    """
    sums = MicroBatchSums()
    for units, norm_sq in micro_batches:
        sums.add(units, units / total_units, norm_sq)
    return sums.estimate(step_norm_sq)


@dataclass
class _Moments:
    """Exponentially weighted sums over the steps: of the weights, their squares, the two estimates and their
    squares. The weight of step t is (1 - r_t) x the product of r over the later steps, r_t = exp(-samples_t / tau),
    so `weight` = 1 - prod r_t (the bias correction) and each estimate's average is its sum / `weight`."""

    weight: float = 0.0
    weight_sq: float = 0.0
    grad_norm_sq: float = 0.0
    grad_norm_sq_sq: float = 0.0
    grad_variance: float = 0.0
    grad_variance_sq: float = 0.0

    def update(self, estimate: StepEstimate, retain: float) -> None:
        new = 1.0 - retain
        self.weight = retain * self.weight + new
        self.weight_sq = retain * retain * self.weight_sq + new * new
        self.grad_norm_sq = retain * self.grad_norm_sq + new * estimate.grad_norm_sq
        self.grad_norm_sq_sq = retain * self.grad_norm_sq_sq + new * estimate.grad_norm_sq**2
        self.grad_variance = retain * self.grad_variance + new * estimate.grad_variance
        self.grad_variance_sq = retain * self.grad_variance_sq + new * estimate.grad_variance**2


class NoiseScale:
    """Smoothed |G|^2, tr(Sigma) and their ratio, the noise scale in samples, over the steps of a run.

    Args:
        time_constant_samples: the averages forget with exp(-samples / time_constant_samples): a step of b samples
            keeps exp(-b / tau) of the past. About 2 tau / b steps count (the effective count, see `lower_bound`).

    Each average is bias-corrected (divided by the total weight, 1 - exp(-samples seen / tau)), so the first step
    counts fully rather than as a fraction of a zero start. A step whose estimates are not finite (an fp16 overflow)
    is skipped: `update` returns `False`. Where not every step measures (one process cutting every fourth step in
    two), `update` is given the run's samples so far: the averages then forget by the samples trained since the last
    step averaged, so that tau spans the same stretch of training however often the noise is measured.

    Example:
        ```python
        noise = NoiseScale(time_constant_samples=4096)
        noise.update(StepEstimate(grad_norm_sq=2.0, grad_variance=40.0), samples=32)
        noise.value  # 20.0 samples
        ```
    """

    def __init__(self, time_constant_samples: float):
        if not (isinstance(time_constant_samples, (int, float)) and 0 < time_constant_samples < math.inf):
            raise ValueError(
                f"time_constant_samples={time_constant_samples!r} must be a positive finite number of samples, "
                "e.g. 4096."
            )
        self.time_constant_samples = float(time_constant_samples)
        self.moments = _Moments()
        self.steps = 0  # steps averaged
        self.skipped = 0  # steps whose estimates were not finite
        self.samples_seen: float | None = None  # the run's samples after the last step averaged, where given
        self.last_averaged = False  # whether the last step given to `update` was averaged in (not skipped)

    def update(self, estimate: StepEstimate, samples: float, samples_seen: float | None = None) -> bool:
        """Average in one step of `samples` samples; `False` (and nothing changed) if its estimates are not
        finite. With `samples_seen`, the run's samples after this step, the past is forgotten by the samples since
        the last step averaged (this one's included) rather than by this step's alone."""
        self.last_averaged = estimate.finite
        if not estimate.finite:
            self.skipped += 1
            return False
        elapsed = samples
        if samples_seen is not None and self.samples_seen is not None:
            elapsed = max(samples, samples_seen - self.samples_seen)
        self.moments.update(estimate, math.exp(-elapsed / self.time_constant_samples))
        self.steps += 1
        if samples_seen is not None:
            self.samples_seen = samples_seen
        return True

    @property
    def grad_norm_sq(self) -> float | None:
        """The averaged |G|^2; `None` before the first step."""
        return self.moments.grad_norm_sq / self.moments.weight if self.steps else None

    @property
    def grad_variance(self) -> float | None:
        """The averaged tr(Sigma), per sample; `None` before the first step."""
        return self.moments.grad_variance / self.moments.weight if self.steps else None

    @property
    def value(self) -> float | None:
        """The noise scale in samples, tr(Sigma) / |G|^2 of the averages (a negative tr(Sigma) counts as 0; an
        averaged |G|^2 <= 0, a gradient not yet told apart from its noise, gives `inf`); `None` before the first
        step."""
        if not self.steps:
            return None
        return _ratio(max(self.grad_variance, 0.0), self.grad_norm_sq)

    @property
    def effective_steps(self) -> float:
        """n_eff = (sum w)^2 / sum w^2 of the steps' weights: as many equally weighted steps would average as
        precisely."""
        return self.moments.weight**2 / self.moments.weight_sq if self.steps else 0.0

    def standard_errors(self) -> tuple[float, float] | None:
        """(standard error of the averaged tr(Sigma), of the averaged |G|^2); `None` before two steps.

        Each is the weighted spread of the steps' estimates around their average, s^2 = sum w (x - mean)^2 / sum w,
        made unbiased and divided by n_eff: s^2 / (n_eff - 1).
        """
        moments, n_eff = self.moments, self.effective_steps
        if self.steps < 2 or n_eff <= 1.0:
            return None

        def error(total: float, total_sq: float) -> float:
            mean = total / moments.weight
            spread = max(total_sq / moments.weight - mean * mean, 0.0)
            return math.sqrt(spread / (n_eff - 1.0))

        return (
            error(moments.grad_variance, moments.grad_variance_sq),
            error(moments.grad_norm_sq, moments.grad_norm_sq_sq),
        )

    def lower_bound(self, z: float = 1.645) -> float | None:
        """A lower confidence bound of the noise scale, in samples: (tr(Sigma) - z se) / (|G|^2 + z se), at least 0.

        The per-step estimates are treated as independent draws around the averages, weighted as the averages
        weigh them. With n_eff = (sum w)^2 / sum w^2 the effective number of steps, each average's standard error is
        se = sqrt(s^2 / (n_eff - 1)), s^2 the weighted spread of the step estimates (`standard_errors`). The bound
        takes the numerator z standard errors low and the denominator z high, so for a one-sided z (1.645: 95% on
        each) it holds at about that level or better, while the estimates are steady (in training they drift, which
        the time constant trades against noise). Returns 0 before two steps (no spread to judge by), `inf` when even
        |G|^2 + z se <= 0 while the numerator is positive, `None` before the first step.
        """
        if not self.steps:
            return None
        errors = self.standard_errors()
        if errors is None:
            return 0.0
        error_variance, error_norm_sq = errors
        low = self.grad_variance - z * error_variance
        if low <= 0.0:
            return 0.0
        return _ratio(low, self.grad_norm_sq + z * error_norm_sq)

    def state_dict(self) -> dict:
        """Plain JSON: what resuming needs to continue the averages exactly."""
        return {
            "steps": self.steps,
            "skipped": self.skipped,
            "samples_seen": self.samples_seen,
            "moments": asdict(self.moments),
        }

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.skipped = int(state["skipped"])
        seen = state["samples_seen"]  # None before the first step measured
        self.samples_seen = None if seen is None else float(seen)
        self.moments = _Moments(**{k: float(v) for k, v in state["moments"].items()})


def _ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator for numerator >= 0, `inf` where the denominator is not positive."""
    if denominator <= 0.0:
        return math.inf if numerator > 0.0 else 0.0
    return numerator / denominator
