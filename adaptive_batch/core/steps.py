"""The step plan: how many samples each optimizer step takes, and from where in the sample stream (the epochs end to
end). See docs/how-it-works.md, "Data, cuts and measurements" (1. Plan). Pure Python."""

from __future__ import annotations

import hashlib
import itertools
import math
from array import array
from dataclasses import dataclass, field
from typing import NamedTuple

from .schedule import Progress, Schedule, check_effective_batch_size


@dataclass(frozen=True)
class Budget:
    """The training budget in samples (data positions), and where it came from, for the log."""

    samples: int
    origin: str

    @classmethod
    def from_epochs(cls, num_train_epochs: float, dataset_size: int) -> Budget:
        if not num_train_epochs > 0:
            raise ValueError(
                f"num_train_epochs={num_train_epochs} must be positive, e.g. num_train_epochs=1."
            )
        samples = round(num_train_epochs * dataset_size)
        return cls(samples, f"num_train_epochs={num_train_epochs:g} x {dataset_size:,} samples")

    @classmethod
    def from_max_steps(cls, max_steps: int, starting_effective_batch_size: int) -> Budget:
        samples = max_steps * starting_effective_batch_size
        return cls(
            samples,
            f"max_steps={max_steps:,} x starting effective batch {starting_effective_batch_size:,} (counted in "
            "samples, so a growing batch shortens the run in steps and a shrinking one lengthens it; num_train_epochs is "
            "ignored, as in the Trainer)",
        )


class DoneSteps(NamedTuple):
    """Steps a plain Trainer's checkpoint trained before the plan takes over."""

    starts: list[int]
    sizes: list[int]
    end: int
    effective_batch_size: int


@dataclass(frozen=True)
class StepPlan:
    """Global samples per optimizer step and where each starts in the sample stream; made by [`build_plan`]."""

    dataset_size: int
    budget: int
    world_size: int
    sizes: array
    scheduled: array
    starts: array
    samples_before_step: array
    notes: tuple[str, ...] = field(default=())
    done_steps: int = 0  # steps trained before the plan took over (a plain Trainer's checkpoint)
    # where the steps are the plain Trainer's (the user's constant batch): its batches' samples over all ranks and
    # its batches an epoch on each rank, which its `TrainerState.epoch` counts
    plain_batches: tuple[int, int] | None = None

    @property
    def num_steps(self) -> int:
        return len(self.sizes)

    @property
    def num_samples(self) -> int:
        return self.samples_before_step[-1]

    @property
    def num_epochs(self) -> int:
        return math.ceil(self.budget / self.dataset_size)

    @property
    def max_rows_per_rank(self) -> int:
        return math.ceil(max(self.sizes[self.done_steps :]) / self.world_size)

    def epoch(self, step: int) -> int:
        return self.starts[step] // self.dataset_size

    def offset(self, step: int) -> int:
        return self.starts[step] % self.dataset_size

    def end_position(self, step: int) -> int:
        """Stream position after `step`, a tail dropped by `drop_last` right after it included."""
        return self.starts[step + 1] if step + 1 < self.num_steps else self.budget

    def ends_epoch(self, step: int) -> bool:
        return self.end_position(step) % self.dataset_size == 0

    def epoch_after(self, step: int) -> float:
        """Data epochs completed after `step`: where the steps are the plain Trainer's, its `TrainerState.epoch` (the
        same float: its batches so far over its batches an epoch), else the samples so far over the dataset's."""
        epochs, offset = divmod(self.end_position(step), self.dataset_size)
        if self.plain_batches is not None:
            batch_samples, batches_per_epoch = self.plain_batches
            return epochs + offset // batch_samples / batches_per_epoch
        return epochs + offset / self.dataset_size

    def max_rows(self, step: int) -> int:
        return math.ceil(self.sizes[step] / self.world_size)

    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        digest.update(f"{self.dataset_size}:{self.budget}:".encode())
        digest.update(self.sizes.tobytes())
        digest.update(self.starts.tobytes())
        return digest.hexdigest()[:16]

    def phases(self) -> list[tuple[int, int, int]]:
        steps = range(self.done_steps, self.num_steps)
        runs = [list(run) for _, run in itertools.groupby(steps, key=self.scheduled.__getitem__)]
        return [(run[0], run[-1], self.scheduled[run[0]]) for run in runs]

    def uneven_steps(self) -> list[tuple[int, int, int]]:
        return [
            (step, self.sizes[step], self.scheduled[step])
            for step in range(self.done_steps, self.num_steps)
            if self.sizes[step] != self.scheduled[step]
        ]


def build_plan(
    schedule: Schedule,
    dataset_size: int,
    budget: Budget | int,
    world_size: int = 1,
    drop_last: bool = False,
    done: DoneSteps | None = None,
    unit: str = "samples",
    plain_batches: tuple[int, int] | None = None,
) -> StepPlan:
    """Cut the sample stream, from 0 (or where `done` steps ended) to the budget, into optimizer steps; a bad
    effective batch or dataset is refused here (`unit` names a dataset row in messages). `plain_batches`: the steps
    are the plain Trainer's ([`StepPlan.plain_batches`]), so an effective batch above the dataset takes each epoch as
    one step, as its steps do, instead of being refused."""
    whole_epochs = plain_batches is not None
    budget_samples = budget.samples if isinstance(budget, Budget) else int(budget)
    if dataset_size < 1:
        raise ValueError(f"The training dataset has {dataset_size} {unit}; it needs at least one.")
    if dataset_size < world_size:
        raise ValueError(
            f"The training dataset has {dataset_size} {unit} but world_size={world_size}: every rank needs at "
            f"least one per step. Use at most {dataset_size} processes or a larger dataset."
        )
    if budget_samples < 1:
        raise ValueError(
            f"The training budget is {budget_samples} samples; set num_train_epochs or max_steps > 0."
        )
    if done is not None and done.end >= budget_samples:
        raise ValueError(
            f"The checkpoint's {len(done.sizes)} steps already used {done.end:,} of the budget's "
            f"{budget_samples:,} samples, so no step is left to train. Raise num_train_epochs / max_steps to "
            "train further, or start a new run."
        )
    done = done or DoneSteps([], [], 0, 0)
    done_count = len(done.sizes)
    sizes, starts = array("q", done.sizes), array("q", done.starts)
    scheduled = array("q", [done.effective_batch_size] * done_count)
    samples_before = array("q", [0, *itertools.accumulate(done.sizes)])
    notes: list[str] = []
    position = done.end  # samples trained so far: samples_before[-1]
    while position < budget_samples:
        progress = Progress(len(sizes), samples_before[-1], position / budget_samples)
        effective = check_effective_batch_size(schedule(progress), f"The schedule at {_where(progress)}")
        _check_fits(effective, world_size, dataset_size, progress, unit, whole_epochs)
        epoch_left = dataset_size - position % dataset_size
        size = min(effective, epoch_left, budget_samples - position)
        if size < effective and size == epoch_left and drop_last:
            position += size  # dataloader_drop_last: the epoch's short last step is not trained on
            continue
        if size < world_size:
            if len(sizes) > done_count and starts[-1] // dataset_size == position // dataset_size:
                sizes[-1] += size  # too few samples for every rank: join the step before, same epoch
                samples_before[-1] += size
            else:
                notes.append(
                    f"{size} sample(s) at the end of the budget are not trained on: fewer than world_size="
                    f"{world_size} and no earlier step of that epoch to join."
                )
            position += size
            continue
        sizes.append(size)
        scheduled.append(effective)
        starts.append(position)
        position += size
        samples_before.append(samples_before[-1] + size)
    if len(sizes) == done_count:
        raise ValueError(
            f"The budget of {budget_samples} samples leaves no optimizer step (drop_last={drop_last}, dataset "
            f"{dataset_size} samples); raise num_train_epochs / max_steps or set dataloader_drop_last=False."
        )
    arrays = (sizes, scheduled, starts, samples_before)
    return StepPlan(
        dataset_size,
        budget_samples,
        world_size,
        *arrays,
        tuple(notes),
        done_steps=done_count,
        plain_batches=plain_batches,
    )


def nearest_multiples(value: int, divisor: int) -> str:
    """The multiples of `divisor` around `value`, as a fix to suggest: 'Use 45 or 50'."""
    lower = value // divisor * divisor
    return f"{lower} or {lower + divisor}" if lower else str(divisor)


def _where(progress: Progress) -> str:
    return f"step {progress.step} ({progress.samples_seen:,} samples seen, fraction {progress.fraction:.3f})"


def _check_fits(
    effective: int, world_size: int, dataset_size: int, progress: Progress, unit: str, whole_epochs: bool
) -> None:
    if effective % world_size:
        raise ValueError(
            f"The effective batch {effective} at {_where(progress)} is not divisible by world_size={world_size}: "
            f"every rank must take the same share. Use {nearest_multiples(effective, world_size)}."
        )
    if effective > dataset_size and not whole_epochs:
        raise ValueError(
            f"The effective batch {effective} at {_where(progress)} exceeds the dataset size {dataset_size} "
            f"{unit}: one optimizer step cannot hold more than one epoch. Give the schedule sizes of at most "
            f"{dataset_size // world_size * world_size} there, or use a larger dataset."
        )
