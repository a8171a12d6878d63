"""Effective-batch schedules: any callable from a [`Progress`] to the samples per optimizer step (all devices); an
`int` is a constant. Pure Python."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

UNITS = ("samples", "steps", "fraction")


class Progress(NamedTuple):
    """Where training stands just before an optimizer step (`fraction`: of the budget's data positions, in [0, 1))."""

    step: int
    samples_seen: int
    fraction: float


Schedule = Callable[[Progress], int]


@dataclass(frozen=True)
class ConstantSchedule:
    effective_batch_size: int

    def __post_init__(self):
        check_effective_batch_size(self.effective_batch_size, where="ConstantSchedule")

    def __call__(self, progress: Progress) -> int:
        return self.effective_batch_size

    def describe(self) -> str:
        return f"{self.effective_batch_size} (constant)"


@dataclass(frozen=True)
class PhaseSchedule:
    """Piecewise-constant effective batch: `sizes[i]` from `boundaries[i - 1]` (inclusive) to `boundaries[i]`, in
    `unit`: `"fraction"` of the training budget (in `(0, 1)`), `"samples"` seen or `"steps"` taken."""

    sizes: Sequence[int]
    boundaries: Sequence[float] = ()  # a default, so that PhaseSchedule([8, 16]) is refused naming them
    unit: str = "fraction"

    def __post_init__(self):
        example = "PhaseSchedule([8, 16], boundaries=[0.5])"
        object.__setattr__(self, "sizes", _as_list(self.sizes, "sizes", example))
        object.__setattr__(self, "boundaries", _as_list(self.boundaries, "boundaries", example))
        if self.unit not in UNITS:
            raise ValueError(
                f"PhaseSchedule unit={self.unit!r} is not one of {UNITS}; use e.g. unit='fraction'."
            )
        if not self.sizes:
            raise ValueError(
                "PhaseSchedule needs at least one size, e.g. PhaseSchedule([8, 16], boundaries=[0.5])."
            )
        for size in self.sizes:
            check_effective_batch_size(size, where="PhaseSchedule sizes")
        if len(self.boundaries) != len(self.sizes) - 1:
            even = [round(k / len(self.sizes), 2) for k in range(1, len(self.sizes))]
            raise ValueError(
                f"PhaseSchedule has {len(self.sizes)} sizes and {len(self.boundaries)} boundaries; it needs one "
                f"boundary fewer than sizes (each boundary starts the next phase), e.g. "
                f"PhaseSchedule({list(self.sizes)}, boundaries={even}) for phases of "
                "equal shares of the budget."
            )
        for boundary in self.boundaries:
            if not finite_number(boundary):
                raise ValueError(
                    f"PhaseSchedule boundary {boundary!r} is not a finite number; each boundary is where a phase "
                    "starts, e.g. boundaries=[0.1, 0.3] (fractions of the budget)."
                )
        if any(later <= earlier for earlier, later in zip(self.boundaries, self.boundaries[1:])):
            raise ValueError(
                f"PhaseSchedule boundaries {list(self.boundaries)} must be strictly increasing; sort them."
            )
        if self.unit == "fraction" and any(not 0 < b < 1 for b in self.boundaries):
            raise ValueError(
                f"PhaseSchedule boundaries {list(self.boundaries)} with unit='fraction' must lie strictly between 0 "
                "and 1 (fractions of the training budget); use unit='samples' or unit='steps' for absolute ones."
            )
        if self.unit != "fraction":
            counted = "optimizer steps taken" if self.unit == "steps" else "samples seen"
            for boundary in self.boundaries:
                if boundary <= 0 or not float(boundary).is_integer():
                    whole = max(1, round(boundary))
                    raise ValueError(
                        f"PhaseSchedule boundary {boundary!r} with unit={self.unit!r} must be a positive integer "
                        f"({counted}); use e.g. {whole}, or unit='fraction' for a share of the training budget "
                        "(boundaries in (0, 1))."
                    )
            object.__setattr__(self, "boundaries", tuple(int(b) for b in self.boundaries))

    def __call__(self, progress: Progress) -> int:
        return self.sizes[self.phase(progress)]

    def phase(self, progress: Progress) -> int:
        positions = {"samples": progress.samples_seen, "steps": progress.step, "fraction": progress.fraction}
        return sum(1 for boundary in self.boundaries if positions[self.unit] >= boundary)

    def describe(self) -> str:
        sizes = " -> ".join(str(s) for s in self.sizes)
        bounds = ", ".join(f"{b:g}" for b in self.boundaries)
        return f"{sizes} (phases start at {bounds} {self.unit})" if self.boundaries else f"{sizes} (constant)"


def as_schedule(schedule: int | Schedule) -> Schedule:
    if isinstance(schedule, bool):
        raise ValueError(
            f"schedule={schedule!r} is a bool; pass an int effective batch or a schedule callable."
        )
    if isinstance(schedule, numbers.Integral):
        return ConstantSchedule(int(schedule))
    if not callable(schedule):
        raise ValueError(
            f"schedule={schedule!r} is neither an int nor a callable; pass e.g. schedule=32 or "
            "schedule=PhaseSchedule([8, 16, 32], boundaries=[0.1, 0.3])."
        )
    return schedule


def describe(schedule: Schedule) -> str:
    if hasattr(schedule, "describe"):
        return schedule.describe()
    return getattr(schedule, "__name__", type(schedule).__name__) + " (callable)"


def _as_list(values, name: str, example: str) -> tuple:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        what = (
            "the effective batch of each phase"
            if name == "sizes"
            else "where each phase after the first starts"
        )
        fix = f"{name}=[{values!r}] or " if isinstance(values, numbers.Real) else ""
        raise ValueError(
            f"PhaseSchedule {name}={values!r} is not a list; it takes {what}, e.g. {fix}{example}."
        )
    return tuple(values)


def finite_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_effective_batch_size(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(
            f"{where} gave effective batch {value!r}; it must be a positive integer number of samples."
        )
    if isinstance(value, numbers.Integral) or (math.isfinite(value) and float(value).is_integer()):
        if value >= 1:
            return int(value)
    raise ValueError(
        f"{where} gave effective batch {value!r}; it must be a positive integer number of samples "
        f"(e.g. {max(1, math.floor(value)) if math.isfinite(value) else 8})."
    )
