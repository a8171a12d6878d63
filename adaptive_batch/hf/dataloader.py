"""The training dataloader: one batch per optimizer step per rank, as the plan cuts the sample stream."""

from __future__ import annotations

import torch.distributed as dist
from torch.utils.data import DataLoader

from ..core.steps import StepPlan
from ..runtime import compat
from ..runtime.sampler import StepBatchSampler
from ..runtime.stream import StepStream, is_stream


def train_dataloader(trainer, plan: StepPlan, seed: int, rank: int, shuffle: bool):
    """The DataLoader `Trainer.get_train_dataloader` returns under AdaptiveBatch, and what draws its steps (a
    [`StepBatchSampler`] over a map-style dataset, a [`StepStream`] over a stream), whose `plan` a growing schedule
    replaces and whose `issued` tells the last step drawn."""
    args = trainer.args
    dataset, collator = compat.train_dataset_and_collator(
        trainer, trainer.train_dataset, trainer.data_collator
    )
    if is_stream(dataset):  # the steps come out of the stream itself, one list of samples each
        shared = args.dataloader_num_workers == 0 and dist.is_available() and dist.is_initialized()
        dataset = steps = StepStream(dataset, plan, rank=rank, max_steps=args.max_steps, shared=shared)
        params = {"batch_size": None}
    else:
        steps = StepBatchSampler(plan, seed=seed, rank=rank, shuffle=shuffle)
        params = {"batch_sampler": steps}
    params |= {
        "collate_fn": collator,
        "num_workers": args.dataloader_num_workers,
        "pin_memory": args.dataloader_pin_memory,
    }
    if args.dataloader_num_workers > 0:
        from transformers.trainer_utils import seed_worker

        params["persistent_workers"] = args.dataloader_persistent_workers
        params["prefetch_factor"] = args.dataloader_prefetch_factor
        params["worker_init_fn"] = _WorkerInit(seed_worker, args.dataloader_num_workers, rank)
    return DataLoader(dataset, **params), steps


class _WorkerInit:
    """Picklable `worker_init_fn` seeding dataloader workers as the Trainer does."""

    def __init__(self, seed_worker, num_workers: int, rank: int):
        self.seed_worker, self.num_workers, self.rank = seed_worker, num_workers, rank

    def __call__(self, worker_id: int) -> None:
        self.seed_worker(worker_id, num_workers=self.num_workers, rank=self.rank)
