"""The training dataloader: one batch per optimizer step per rank, yielded as `gradient_accumulation_steps` slots
(the step batch last) so that the loop's counts are the plain Trainer's. See docs/how-it-works.md, "What happens inside"."""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, Sampler

from ..core.steps import StepPlan
from ..runtime.compat.trainer import pad_to_multiple_of, train_dataset_and_collator, user_class
from ..runtime.sampler import StepBatchSampler
from ..runtime.stream import StepStream, is_stream


@dataclass(frozen=True)
class Slots:
    """The loop's batches for a step (the last carries its samples): `gradient_accumulation_steps`, or at the short
    last step of an epoch of a fixed plan (`plan`; `None` where it may grow) the plain Trainer's fewer, so that the
    loop's events and its division of a mean loss are the plain Trainer's there."""

    accumulation: int
    per_device_train_batch_size: int
    plan: StepPlan | None

    def __call__(self, step: int) -> int:
        plan = self.plan
        if plan is None or not plan.ends_epoch(step):
            return self.accumulation
        return min(self.accumulation, math.ceil(plan.max_rows(step) / self.per_device_train_batch_size))


def train_dataloader(trainer, plan: StepPlan, seed: int, rank: int, shuffle: bool, slots: Slots):
    """The DataLoader `Trainer.get_train_dataloader` returns, and what draws its steps (its `issued`: the last
    drawn)."""
    args = trainer.args
    dataset, collator = train_dataset_and_collator(trainer, trainer.train_dataset, trainer.data_collator)
    if is_stream(dataset):  # the steps come out of the stream itself, one list of samples each
        shared = args.dataloader_num_workers == 0 and dist.is_available() and dist.is_initialized()
        steps = StepStream(dataset, plan, rank=rank, max_steps=args.max_steps, shared=shared)
        dataset, params = _SlottedStream(steps, slots), {"batch_size": None}
    else:
        steps = StepBatchSampler(plan, seed=seed, rank=rank, shuffle=shuffle)
        params = {"batch_sampler": _SlottedSteps(steps, slots)}
    params |= {
        "collate_fn": functools.partial(_collate_step, collator),
        "num_workers": args.dataloader_num_workers,
        "pin_memory": args.dataloader_pin_memory,
    }
    if args.dataloader_num_workers > 0:
        from transformers.trainer_utils import seed_worker

        params["persistent_workers"] = args.dataloader_persistent_workers
        params["prefetch_factor"] = args.dataloader_prefetch_factor
        params["worker_init_fn"] = functools.partial(
            seed_worker, num_workers=args.dataloader_num_workers, rank=rank
        )
    total_batch_size = args.per_device_train_batch_size * plan.world_size
    return StepDataLoader(dataset, steps, total_batch_size, **params), steps


class StepDataLoader(DataLoader):
    """The training DataLoader, answering what accelerate's prepared one answers where the Trainer and callbacks read
    it: `total_batch_size` (the plain Trainer's per-device batch x processes, as accelerate counts it),
    `total_dataset_length`, `set_epoch` (the sampler then yields that data epoch's steps) and `iteration`."""

    def __init__(self, dataset, steps: StepBatchSampler | StepStream, total_batch_size: int, **params):
        super().__init__(dataset, **params)
        self.steps, self.total_batch_size, self.iteration = steps, total_batch_size, 0

    @property
    def total_dataset_length(self) -> int:
        dataset = self.steps.stream if isinstance(self.steps, StepStream) else self.dataset
        return getattr(dataset, "total_length", None) or len(dataset)

    def set_epoch(self, epoch: int) -> None:
        self.iteration = epoch
        if isinstance(self.steps, StepBatchSampler):
            self.steps.set_epoch(epoch)


class _Slotted:
    """Each step's batch (of indices, or of samples) as the last of `slots(step)` batches, the others empty."""

    def __init__(self, steps: StepBatchSampler | StepStream, slots: Slots):
        self.steps, self.slots = steps, slots

    def __iter__(self):
        for batch in self.steps:
            for _ in range(self.slots(self.steps.issued) - 1):
                yield []
            yield batch


class _SlottedSteps(_Slotted, Sampler[list[int]]):
    def __len__(self) -> int:
        return sum(self.slots(step) for step in self.steps.steps())


class _SlottedStream(_Slotted, IterableDataset):
    """A stream's steps, with no length: the loop takes its counts from the plan."""


def _collate_step(collator, samples):
    """The user's collator for the step batches; `None` for an empty slot (no samples to collate)."""
    return collator(samples) if len(samples) else None


class EmptySlot(dict):
    """An empty slot as the loop sees it: the step batch's tensors with no rows (its loss is 0; its tokens and FLOPs
    are counted as those of the plain Trainer's batch it stands for: [`LoopCounts`])."""


def plain_shares(trainer, step_batch, slots: int, rows: int) -> list[dict] | None:
    """The plain Trainer's batches of a step, for its per-batch counts (tokens seen, FLOPs): slot `i` holds rows
    `i * per_device_train_batch_size` on (the last slot the rest), cut to the width a padding collator gives those
    rows (their longest, rounded up to its `pad_to_multiple_of`) where the step batch is padded to its longest; `None`
    where its rows are not the step's `rows` samples (a collator that flattens the step into one row)."""
    per_device, multiple = trainer.args.per_device_train_batch_size, pad_to_multiple_of(trainer)
    tensors = {
        key: value for key, value in step_batch.items() if isinstance(value, torch.Tensor) and value.dim()
    }
    width = next((v.shape[1] for v in tensors.values() if v.dim() >= 2), None)
    if not tensors or any(v.shape[0] != rows for v in tensors.values()):
        return None
    mask = step_batch.get("attention_mask")
    lengths = None
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] == width:
        # each row up to its last unmasked token (right padding); a width beyond the longest is a fixed width
        lengths = width - (1 - mask.long().flip(-1)).cumprod(-1).sum(-1)
        if width > -(-int(lengths.max()) // multiple) * multiple:
            lengths = None
    shares = []
    for slot in range(slots):
        start = min(slot * per_device, rows)  # (a step smaller than the user's leaves the last slots empty)
        end = rows if slot == slots - 1 else min(start + per_device, rows)
        cut = width
        if lengths is not None and end > start:
            cut = -(-int(lengths[start:end].max()) // multiple) * multiple
        shares.append(
            {
                key: value[start:end, :cut]
                if value.dim() >= 2 and value.shape[1] == width
                else value[start:end]
                for key, value in tensors.items()
            }
        )
    return shares


class LoopCounts:
    """What the loop counts for each of its batches (tokens seen, FLOPs): those of the plain Trainer's batch it stands
    for ([`plain_shares`]), not the whole step at its last. FLOPs: where the Trainer's `floating_point_ops` is the
    library's (6 x parameters x the main input's tokens), read once, then the same count times the tokens, exactly;
    the library's own walks every parameter of the model for each loop batch, which for a step of many loop batches
    (the user's accumulation) costs more than the step's one micro-batch. A Trainer class of the user's that defines
    it is asked every time."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.shares: dict[
            int, dict
        ] = {}  # this step's loop batches (by id): the plain Trainer's batch of each
        self.flops_per_token: int | None = None

    def follow_step(self, batches: list, rows: int) -> None:
        """This step's loop batches, the last holding this rank's `rows` samples."""
        shares = plain_shares(self.trainer, batches[-1], len(batches), rows) if batches else None
        self.shares = (
            {id(batch): share for batch, share in zip(batches, shares)} if shares is not None else {}
        )

    def share(self, inputs):
        """The plain Trainer's batch the loop batch `inputs` stands for; `inputs` itself where that is not known."""
        return self.shares.get(id(inputs), inputs)

    def floating_point_ops(self, inner, inputs) -> float:
        inputs = self.share(inputs)
        main_input = getattr(self.trainer.model, "main_input_name", "input_ids")
        main = inputs.get(main_input) if hasattr(inputs, "get") else None
        if self.flops_per_token is not None and isinstance(main, torch.Tensor):
            return self.flops_per_token * main.numel()
        flops = inner(inputs)
        library = user_class(self.trainer, "floating_point_ops").__module__.startswith("transformers.")
        if library and isinstance(main, torch.Tensor) and main.numel() and flops:
            per_token, rest = divmod(int(flops), main.numel())
            self.flops_per_token = per_token if rest == 0 and per_token * main.numel() == flops else None
        return flops


def batch_samples(inner, epoch_iterator, slots: int, device) -> tuple[list, object]:
    """`Trainer.get_batch_samples` over one step's slots: `num_items_in_batch` the step batch's, the empty slots before
    it (the loop synchronises gradients at a step's last batch)."""
    drawn = list(itertools.islice(epoch_iterator, slots))
    steps = [batch for batch in drawn if batch is not None]
    batches, num_items = inner(iter(steps), len(steps), device)
    if not batches:
        return batches, num_items
    tensors = {key: value[:0] for key, value in batches[0].items() if isinstance(value, torch.Tensor)}
    return [EmptySlot(tensors) for _ in range(len(drawn) - len(steps))] + batches, num_items
