"""Every private attribute of the Trainer, TRL and accelerate that AdaptiveBatch reads or sets, in one place.

When a release renames one of these, this is the file to change. Each entry says where the attribute comes from
and why AdaptiveBatch touches it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

# -- transformers.Trainer ----------------------------------------------------------------------------------------


def set_loss_divisor(trainer, divisor: float) -> None:
    """`Trainer.training_step` divides a loss computed without `num_items_in_batch` (a per-micro-batch mean) by
    `current_gradient_accumulation_steps`; AdaptiveBatch sets it to the micro-batch's weight in the step."""
    trainer.current_gradient_accumulation_steps = divisor


def loss_shifts_labels(trainer) -> bool:
    """Whether the Trainer counts label tokens after shifting (`Trainer._loss_shifts_labels`, as it does when it
    counts `num_items_in_batch`)."""
    return bool(getattr(trainer, "_loss_shifts_labels", False))


def loss_normalised_over_ranks(trainer) -> bool:
    """Whether `Trainer.compute_loss` normalises the loss by `num_items_in_batch` counted over all ranks (and
    multiplies it by the number of processes, so that the ranks' average is the step's mean): with
    `average_tokens_across_devices` and a model or `compute_loss_func` that takes `num_items_in_batch`
    (`model_accepts_loss_kwargs`)."""
    args = trainer.args
    takes_items = bool(getattr(trainer, "model_accepts_loss_kwargs", False)) or (
        getattr(trainer, "compute_loss_func", None) is not None
    )
    return bool(getattr(args, "average_tokens_across_devices", False)) and takes_items


def train_dataset_and_collator(trainer, dataset, collator):
    """The dataset and collator as `Trainer.get_train_dataloader` would use them: unused columns removed
    (`_remove_unused_columns` for a `datasets.Dataset`, `_get_collator_with_removed_columns` otherwise)."""
    from .lengths import is_hf_dataset

    if is_hf_dataset(dataset):
        return trainer._remove_unused_columns(dataset, description="training"), collator
    return dataset, trainer._get_collator_with_removed_columns(collator, description="training")


# -- TRL's SFTTrainer --------------------------------------------------------------------------------------------


def padding_free(trainer) -> bool:
    """Whether the collator flattens each batch into one row of sequences: `DataCollatorWithFlattening`, a collator
    with `padding_free` set, or TRL's SFTTrainer with `padding_free` (its `packing=True` with "bfd" sets it)."""
    from transformers import DataCollatorWithFlattening

    collator = trainer.data_collator
    return (
        isinstance(collator, DataCollatorWithFlattening)
        or bool(getattr(collator, "padding_free", False))
        or bool(getattr(trainer, "padding_free", False))
    )


class TrlMetrics:
    """TRL's SFTTrainer counts tokens (`_total_train_tokens`) and appends metrics (`_metrics["train"]`) on every
    `compute_loss` call. A step run again after an out-of-memory error would count them twice, and a row that adds
    nothing would count its tokens: keep the metrics of the last attempt only, and set the token count to the step's
    real tokens."""

    def __init__(self, trainer):
        self.trainer = trainer
        metrics = getattr(trainer, "_metrics", None)
        self.lists = metrics.get("train") if isinstance(metrics, dict) else None
        self.lengths = (
            {key: len(values) for key, values in self.lists.items()} if self.lists is not None else {}
        )
        self.total_tokens = getattr(trainer, "_total_train_tokens", None)

    def restore(self) -> None:
        if self.lists is not None:
            for key in list(self.lists):
                if key in self.lengths:
                    del self.lists[key][self.lengths[key] :]
                else:
                    del self.lists[key]
        if self.total_tokens is not None:
            self.trainer._total_train_tokens = self.total_tokens

    def correct(self, real_tokens: int) -> None:
        if self.total_tokens is None or not isinstance(self.total_tokens, (int, float)):
            return
        self.trainer._total_train_tokens = self.total_tokens + real_tokens
        if self.lists is not None and "num_tokens" in self.lists:
            self.lists["num_tokens"] = [self.trainer._total_train_tokens]


# -- accelerate ----------------------------------------------------------------------------------------------------

# The collectives the Trainer and TRL call through the Accelerator inside a micro-batch (TRL's `compute_loss` gathers
# its token counts, entropy and accuracy with `gather_for_metrics`). A rank that ran out of memory before reaching
# one would leave the others waiting in it for ever.
GUARDED_COLLECTIVES = ("gather", "gather_for_metrics", "reduce", "pad_across_processes")


@contextlib.contextmanager
def before_collectives(accelerator, check: Callable[[], None]) -> Iterator[None]:
    """Call `check()` before each of the Accelerator's collectives (outermost calls only: `gather_for_metrics`
    calls `gather`), on this Accelerator instance, for the duration of the block.

    `check` exchanges an "all well so far" flag between the ranks and raises on every rank once one of them has
    failed, so that no rank enters a collective that another rank will never reach.
    """
    depth = 0
    saved: dict[str, object] = {}

    def guard(method):
        def guarded(*args, **kwargs):
            nonlocal depth
            if depth == 0:
                check()
            depth += 1
            try:
                return method(*args, **kwargs)
            finally:
                depth -= 1

        return guarded

    for name in GUARDED_COLLECTIVES:
        method = getattr(accelerator, name, None)
        if method is None:
            continue
        saved[name] = accelerator.__dict__.get(name, _ABSENT)
        setattr(accelerator, name, guard(method))
    try:
        yield
    finally:
        for name, previous in saved.items():
            if previous is _ABSENT:
                delattr(accelerator, name)
            else:
                setattr(accelerator, name, previous)


_ABSENT = object()


def loss_scale(trainer) -> float:
    """The factor an fp16 GradScaler (`Accelerator.scaler`) multiplies the loss by: the gradients hold it until the
    Trainer unscales them before clipping. 1 without one."""
    scaler = getattr(trainer.accelerator, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return 1.0
    return float(scaler.get_scale())


def no_sync(trainer, model: torch.nn.Module):
    """Keep gradients local (DDP's `no_sync`, through the Accelerator) until the step's single reduction."""
    return trainer.accelerator.no_sync(model)


def ddp_forget_forward(model: torch.nn.Module) -> None:
    """DDP (`DistributedDataParallel.require_forward_param_sync`) flips this flag after a forward completes; a
    forward cut short by an error left it behind on some ranks, which would make them alone broadcast buffers in the
    next forward. Every completed `no_sync` forward sets it to False."""
    if hasattr(model, "require_forward_param_sync"):
        model.require_forward_param_sync = False


# -- torch FSDP2 ---------------------------------------------------------------------------------------------------


def fsdp2_reset(model: torch.nn.Module) -> None:
    """Undo a forward or backward that an error cut short under FSDP2 (`fully_shard`): the root module's
    `reset_iter_state()` (torch >= 2.11) waits on in-flight collectives, reshards every parameter group and clears
    the iteration's trackers and its unreduced gradients."""
    reset = getattr(model, "reset_iter_state", None)
    if reset is None:
        raise RuntimeError(
            f"Cannot undo a failed micro-batch under FSDP2: {type(model).__name__} has no reset_iter_state "
            f"(torch {torch.__version__}); torch >= 2.11 has it. Upgrade torch, or set AdaptiveBatch("
            "micro_batch_size=N) to a size that fits (adaptive-batch probe finds it)."
        )
    reset()


def is_fsdp2(trainer) -> bool:
    """Whether the Trainer's FSDP is FSDP2 (as `Trainer` itself tells: the Accelerator's `fsdp_plugin.fsdp_version`)."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    return getattr(plugin, "fsdp_version", 1) == 2
