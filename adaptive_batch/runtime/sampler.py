"""The step sampler: one batch of dataset indices per optimizer step, this rank's share of the step's samples."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from ..core.steps import StepPlan


class StepBatchSampler(Sampler[list[int]]):
    """Yields, for each planned optimizer step, this rank's dataset indices, a pure function of (seed, plan, step).
    The plan may be replaced while iterated; `issued`, the last step drawn, tells what it must leave as it was. After
    `set_epoch(epoch)` it yields that data epoch's steps only, as a sampler the Trainer iterates once an epoch."""

    def __init__(self, plan: StepPlan, seed: int, rank: int = 0, shuffle: bool = True, start_step: int = 0):
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"rank={rank} is outside world_size={plan.world_size}.")
        self.plan, self.seed, self.rank, self.shuffle, self.start_step = plan, seed, rank, shuffle, start_step
        self._permutation: tuple[int, torch.Tensor] | None = None
        self.issued = start_step - 1
        self.epoch: int | None = None  # (None: every step)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return sum(1 for _ in self.steps())

    def __iter__(self) -> Iterator[list[int]]:
        for step in self.steps():
            self.issued = step
            yield self.indices(step)

    def steps(self) -> Iterator[int]:
        """The steps it yields (their indices), as the plan stands."""
        step = self.start_step
        if self.epoch is not None:
            while step < self.plan.num_steps and self.plan.epoch(step) < self.epoch:
                step += 1
        while step < self.plan.num_steps and (self.epoch is None or self.plan.epoch(step) == self.epoch):
            yield step  # (the plan is read at every step: a new one may replace it)
            step += 1

    def indices(self, step: int) -> list[int]:
        offset = self.plan.offset(step)
        order = self.permutation(self.plan.epoch(step))
        return order[offset + self.rank : offset + self.plan.sizes[step] : self.plan.world_size].tolist()

    def permutation(self, epoch: int) -> torch.Tensor:
        if self._permutation is None or self._permutation[0] != epoch:
            size = self.plan.dataset_size
            if self.shuffle:
                order = torch.randperm(size, generator=torch.Generator().manual_seed(self.seed + epoch))
            else:
                order = torch.arange(size)
            self._permutation = (epoch, order)
        return self._permutation[1]
