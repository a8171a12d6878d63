"""A training stream cut into the plan's steps, read once in order. See docs/how-it-works.md, "1. Plan"."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from ..core.steps import StepPlan


def is_stream(dataset) -> bool:
    """Whether the training dataset is read as a stream: an `IterableDataset` or anything without a length."""
    return isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__")


class StreamEndedError(ValueError):
    pass


class StepStream(IterableDataset):
    """Yields, for each planned step, this rank's samples; `shared`: rank 0 reads the stream and scatters shares."""

    def __init__(self, stream, plan: StepPlan, rank: int, max_steps: int | None, shared: bool):
        self.stream, self.plan, self.rank, self.max_steps = stream, plan, rank, max_steps
        self.shared = shared and plan.world_size > 1
        self.issued = -1

    def __iter__(self) -> Iterator[list]:
        worker = get_worker_info()
        if worker is not None and worker.id != 0:  # each worker holds a copy of the stream: one reads it
            return
        steps = self._shares() if self.rank == 0 or not self.shared else None
        step = 0
        while step < self.plan.num_steps:  # (read at every step: a new plan may change it)
            batch = self._receive(steps) if self.shared else next(steps)[self.rank]
            self.issued = step
            yield batch
            step += 1

    def _shares(self) -> Iterator[list[list]]:
        samples, read, step = iter(self.stream), 0, 0
        while step < self.plan.num_steps:
            size, world = self.plan.sizes[step], self.plan.world_size
            skip = max(0, self.plan.starts[step] - read)  # (positions the plan leaves out, if any)
            taken = list(itertools.islice(samples, skip + size))
            read += len(taken)
            if len(taken) < skip + size:
                limit = (
                    f"max_steps={self.max_steps:,} x the starting effective batch"
                    if self.max_steps
                    else "the budget"
                )
                raise StreamEndedError(
                    f"The training stream ended after {read:,} samples; {limit} is {self.plan.budget:,} samples, read "
                    "once in order. Make the stream longer (datasets: `dataset.repeat(None)` reads it again and "
                    "again) or lower max_steps."
                )
            yield [taken[skip + rank :: world] for rank in range(world)]
            step += 1

    def _receive(self, steps: Iterator[list[list]] | None) -> list:
        """This rank's share of the next step, read by rank 0; a stream that ended raises on every rank."""
        shares = None
        if self.rank == 0:
            try:
                shares = next(steps)
            except StreamEndedError as error:
                shares = [error] * self.plan.world_size
        received = [None]
        dist.scatter_object_list(received, shares, src=0)
        if isinstance(received[0], StreamEndedError):
            raise received[0]
        return received[0]
