"""The step sampler: one batch of dataset indices per optimizer step, this rank's share of the step's samples."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from ..core.steps import StepPlan


class StepBatchSampler(Sampler[list[int]]):
    """Yields, for each planned optimizer step, this rank's dataset indices, a pure function of (seed, plan, step).
    The plan may be replaced while iterated; `issued`, the last step drawn, tells what it must leave as it was."""

    def __init__(self, plan: StepPlan, seed: int, rank: int = 0, shuffle: bool = True, start_step: int = 0):
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"rank={rank} is outside world_size={plan.world_size}.")
        self.plan, self.seed, self.rank, self.shuffle, self.start_step = plan, seed, rank, shuffle, start_step
        self._permutation: tuple[int, torch.Tensor] | None = None
        self.issued = start_step - 1

    def __len__(self) -> int:
        return self.plan.num_steps - self.start_step

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start_step
        while step < self.plan.num_steps:
            self.issued = step
            yield self.indices(step)
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
