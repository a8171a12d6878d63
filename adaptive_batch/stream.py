"""A training stream (an `IterableDataset`, or `datasets` streaming) cut into the plan's steps.

A stream has no length and no random access, so it has no epochs to plan over and no permutation to draw from.
AdaptiveBatch plans it as one pass over the budget, `max_steps x the starting effective batch` samples (the Trainer
requires `max_steps` for a stream), and reads it in order: step `k` takes the next `plan.sizes[k]` samples, of
which rank `r` of `world_size` keeps every `world_size`-th starting at the `r`-th, as the step sampler does with a
map-style dataset. Every rank reads the whole stream (give each rank the same stream: a stream already split by
node would lose the other ranks' samples). A stream that ends before the budget is an error, not a silent restart.

A resumed run skips the steps already trained by reading them again (the Trainer skips a resumed run's first
batches), so the samples after the checkpoint are exactly those the uninterrupted run would have read next.

With DataLoader workers only the first worker reads: each worker holds a copy of the stream and would otherwise read
it from the start again. The plan is read when each step is drawn, so a `NoiseScaleSchedule` that plans the rest of
the run again is followed, in the main process (no workers); `issued` is the last step drawn.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import IterableDataset, get_worker_info

from .plan import StepPlan


def is_stream(dataset) -> bool:
    """Whether the training dataset is read as a stream: an `IterableDataset` or anything without a length."""
    return isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__")


class StreamEndedError(ValueError):
    pass


class StepStream(IterableDataset):
    """Yields, for each planned optimizer step, the list of this rank's samples (the collator makes the batch).

    Args:
        stream: the user's training stream.
        plan: the step plan (one pass over the budget: `plan.dataset_size == plan.budget`).
        rank: this process's index among the data-parallel ranks.
        max_steps: the `max_steps` the budget came from, for the error when the stream ends early.
    """

    def __init__(self, stream, plan: StepPlan, rank: int = 0, max_steps: int | None = None):
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"rank={rank} is outside world_size={plan.world_size}.")
        self.stream, self.plan, self.rank, self.max_steps = stream, plan, rank, max_steps
        self.issued = -1

    def __iter__(self) -> Iterator[list]:
        worker = get_worker_info()
        if worker is not None and worker.id != 0:
            return
        samples = iter(self.stream)
        read = 0
        step = 0
        while step < self.plan.num_steps:
            size, world = self.plan.sizes[step], self.plan.world_size
            for _ in range(self.plan.starts[step] - read):  # (positions the plan leaves out, if any)
                self._next(samples, read)
                read += 1
            batch = []
            for index in range(size):
                sample = self._next(samples, read)
                read += 1
                if index % world == self.rank:
                    batch.append(sample)
            self.issued = step
            yield batch
            step += 1

    def _next(self, samples: Iterator, read: int):
        try:
            return next(samples)
        except StopIteration:
            raise StreamEndedError(self._ended(read)) from None

    def _ended(self, read: int) -> str:
        budget = self.plan.budget
        steps = (
            f"max_steps={self.max_steps:,} x the starting effective batch" if self.max_steps else "the budget"
        )
        return (
            f"The training stream ended after {read:,} samples; {steps} is {budget:,} samples, read once in order. "
            "Make the stream longer (datasets: `dataset.repeat(None)` reads it again and again) or lower max_steps."
        )
