"""What the plain Trainer does with the user's batch settings: its optimizer steps and the samples each takes, for the
plan table and to take over from (or hand back to) its checkpoints. Pure Python."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .steps import DoneSteps


@dataclass(frozen=True)
class PlainBatching:
    """The user's batch settings, as the plain Trainer applies them to a dataset."""

    dataset_size: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    world_size: int = 1
    drop_last: bool = False

    @property
    def effective_batch_size(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size

    @property
    def batches_per_epoch(self) -> int:
        """The Trainer's `steps_in_epoch`: its dataloader's batches an epoch on each rank."""
        size, per_device = self.dataset_size, self.per_device_train_batch_size
        batches = size // per_device if self.drop_last else math.ceil(size / per_device)
        return batches // self.world_size if self.drop_last else math.ceil(batches / self.world_size)

    @property
    def steps_per_epoch(self) -> int:
        """The Trainer's `num_update_steps_per_epoch`."""
        return max(1, math.ceil(self.batches_per_epoch / self.gradient_accumulation_steps))

    def total_steps(self, num_train_epochs: float, max_steps: int = -1) -> int:
        return max_steps if max_steps > 0 else math.ceil(num_train_epochs * self.steps_per_epoch)

    def step_sizes(self, num_steps: int) -> list[int]:
        effective, per_epoch = self.effective_batch_size, self.steps_per_epoch
        return [
            max(0, min(effective, self.dataset_size - step % per_epoch * effective))
            for step in range(num_steps)
        ]

    def position_after(self, num_steps: int) -> int:
        """Dataset positions the first `num_steps` steps consume, an epoch's dropped tail included."""
        epochs, within = divmod(num_steps, self.steps_per_epoch)
        return epochs * self.dataset_size + min(within * self.effective_batch_size, self.dataset_size)

    def done_steps(self, num_steps: int) -> DoneSteps:
        sizes = self.step_sizes(num_steps)
        starts = [self.position_after(step) for step in range(num_steps)]
        return DoneSteps(starts, sizes, self.position_after(num_steps), self.effective_batch_size)


def plain_resume_mismatch(
    plain: PlainBatching, position: int, steps: int, lr_steps: int, plain_lr_steps: int
) -> str | None:
    """Why the plain Trainer, resuming a checkpoint AdaptiveBatch wrote after `steps` steps, would not go on from
    where the run was (`None`: it would): the samples taken (`position`) or the LR schedule's length differ."""
    expected = plain.position_after(steps)
    if position != expected:
        return (
            f"its {steps:,} optimizer steps took {position:,} samples, where the plain Trainer's {steps:,} steps of "
            f"{plain.effective_batch_size:,} take {expected:,}"
        )
    if lr_steps != plain_lr_steps:
        return (
            f"its learning-rate schedule was built for {lr_steps:,} steps, where the plain Trainer's is built for "
            f"{plain_lr_steps:,}"
        )
    return None
