"""The gradient noise scale of McCandlish et al. (2018) from a step's micro-batches: per-step estimates
([`MicroBatchSums`]), averaged ([`NoiseScale`]). See docs/how-it-works.md, "Gradient noise scale". Pure Python."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields

SHARE_TOLERANCE = 1e-6  # the shares of a step's micro-batches add up to 1 within this (float rounding)
PRECONDITIONERS = ("none", "adam")  # the gradients measured raw, or divided by Adam's denominator


@dataclass(frozen=True)
class StepEstimate:
    """One step's unbiased estimates of |G|^2 (`grad_norm_sq`) and tr(Sigma) (`grad_variance`, per sample or unit)."""

    grad_norm_sq: float
    grad_variance: float

    @property
    def finite(self) -> bool:
        return math.isfinite(self.grad_norm_sq) and math.isfinite(self.grad_variance)


@dataclass
class MicroBatchSums:
    """A step's micro-batches as sums: S_small (`small`), A = sum_j a_j / n_j, B = sum_j a_j^2 / n_j, the shares sum_j
    a_j (1 when all counted), the units sum_j n_j and the count M (docs/how-it-works.md, "Gradient noise scale")."""

    small: float = 0.0
    share_per_unit: float = 0.0
    share_sq_per_unit: float = 0.0
    shares: float = 0.0
    units: float = 0.0
    count: float = 0.0

    def add(self, units: float, share: float, norm_sq: float) -> None:
        self.small += norm_sq / share
        self.share_per_unit += share / units
        self.share_sq_per_unit += share * share / units
        self.shares += share
        self.units += units
        self.count += 1

    @property
    def complete(self) -> bool:
        return abs(self.shares - 1.0) <= SHARE_TOLERANCE

    def estimate(self, step_norm_sq: float, samples: float | None = None) -> StepEstimate | None:
        """|G|^2 = (A S_big - B S_small) / (A - B), tr(Sigma) = (S_small - S_big) / (A - B) (per unit, or x `samples`
        / units per sample); `None` with fewer than 2 micro-batches."""
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


@dataclass
class _Moments:
    """Exponentially weighted sums of the weights, both estimates and their squares; `weight`: bias correction."""

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
    """Smoothed |G|^2, tr(Sigma) and their ratio, the noise scale in samples: bias-corrected averages that forget with
    exp(-samples / `time_constant_samples`); steps whose estimates are not finite are skipped."""

    def __init__(self, time_constant_samples: float):  # (checked as `noise_time_constant_samples`)
        self.time_constant_samples = float(time_constant_samples)
        self.moments = _Moments()
        self.steps = 0  # steps averaged
        self.skipped = 0  # steps whose estimates were not finite
        self.samples_seen: float | None = None  # the run's samples after the last step averaged, where given
        self.last_averaged = False  # whether the last step given to `update` was averaged in (not skipped)

    def update(self, estimate: StepEstimate, samples: float, samples_seen: float | None = None) -> bool:
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
        return self.moments.grad_norm_sq / self.moments.weight if self.steps else None

    @property
    def grad_variance(self) -> float | None:
        return self.moments.grad_variance / self.moments.weight if self.steps else None

    @property
    def value(self) -> float | None:
        """tr(Sigma) / |G|^2 of the averages (a negative tr(Sigma) counts as 0; |G|^2 <= 0 gives `inf`)."""
        return _ratio(max(self.grad_variance, 0.0), self.grad_norm_sq) if self.steps else None

    @property
    def effective_steps(self) -> float:
        """n_eff = (sum w)^2 / sum w^2: as many equally weighted steps would average as precisely."""
        return self.moments.weight**2 / self.moments.weight_sq if self.steps else 0.0

    def standard_errors(self) -> tuple[float, float] | None:
        """(standard error of the averaged tr(Sigma), of the averaged |G|^2); `None` before two steps."""
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
        """A lower confidence bound of the noise scale, (tr(Sigma) - z se) / (|G|^2 + z se), at least 0."""
        if not self.steps:
            return None
        errors = self.standard_errors()
        if errors is None:
            return 0.0
        error_variance, error_norm_sq = errors
        low = self.grad_variance - z * error_variance
        return 0.0 if low <= 0.0 else _ratio(low, self.grad_norm_sq + z * error_norm_sq)

    def state_dict(self) -> dict:
        return {
            "steps": self.steps,
            "skipped": self.skipped,
            "samples_seen": self.samples_seen,
            "moments": asdict(self.moments),
        }

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.skipped = int(state["skipped"])
        seen = state["samples_seen"]
        self.samples_seen = None if seen is None else float(seen)
        self.moments = _Moments(**{k: float(v) for k, v in state["moments"].items()})


def _ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator; `inf` (0 for a zero numerator) where the denominator is not positive."""
    if denominator <= 0.0:
        return math.inf if numerator > 0.0 else 0.0
    return numerator / denominator
