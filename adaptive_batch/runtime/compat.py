"""Every private attribute of the Trainer, TRL, accelerate, FSDP2 and DeepSpeed that AdaptiveBatch reads or sets, in
one place.

When a release renames one of these, this is the file to change. Each entry says where the attribute comes from
and why AdaptiveBatch touches it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator

import torch

# private modules of torch the probe's trials use: a dispatch mode that sees every operator, and pytree flattening
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401  (re-exported for probe/trials.py)
from torch.utils._pytree import tree_flatten  # noqa: F401  (re-exported for probe/trials.py)

# -- transformers.Trainer ----------------------------------------------------------------------------------------

# The Trainer methods AdaptiveBatch replaces with its step sampler; a user's class that overrides one is refused.
REPLACED_DATA_METHODS = ("get_train_dataloader", "_get_train_sampler")

# Keys of a model config that do not change memory (the probe's cache compares the rest): `_name_or_path` is the
# folder or hub name `from_pretrained` records.
CONFIG_BOOKKEEPING_KEYS = (
    "_name_or_path",
    "transformers_version",
    "architectures",
    "torch_dtype",
    "dtype",
    "use_cache",
)


def trainer_being_built(callback):
    """The Trainer whose `__init__` is calling `callback.on_init_end`, or `None`.

    transformers passes callbacks no Trainer (`CallbackHandler.call_event` gives them the model, the optimizer and
    the dataloaders), so it is read from the frame of `Trainer.__init__` itself: the nearest caller running exactly
    that code object (`__init__` -> `CallbackHandler.on_init_end` -> `call_event` -> the callback), whose `self` is
    the Trainer and holds `callback`. Any other frame is passed over; a release that builds callbacks otherwise
    gives `None`, and the caller says to use `AdaptiveBatch.attach(trainer)`.
    """
    from transformers import Trainer

    init = inspect.unwrap(Trainer.__init__).__code__
    frame = inspect.currentframe()
    try:
        for _ in range(16):  # the handler's two calls, a subclass's on_init_end, decorators
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            if frame.f_code is init:
                trainer = frame.f_locals.get("self")
                handler = getattr(trainer, "callback_handler", None)
                return trainer if callback in getattr(handler, "callbacks", ()) else None
        return None
    finally:
        del frame


def put_in_front(trainer, mixin: type, prefix: str) -> None:
    """Give this Trainer instance a class of its own, `prefix` + its class's name, with `mixin` in front of its class,
    so that the mixin's methods replace the Trainer's for this instance only (other Trainers of the class are
    untouched)."""
    cls = type(trainer)
    trainer.__class__ = type(f"{prefix}{cls.__name__}", (mixin, cls), {})


class KeepsLiveCallbackState:
    """`Trainer._load_callback_state` re-creates every stateful callback from a checkpoint's `stateful_callbacks`
    when it resumes. AdaptiveBatch's callback keeps its live objects instead (its state was read when `train`
    started): its entry is taken out while the others are restored, then put back."""

    callback_state_key: str

    def _load_callback_state(self):
        key = self.callback_state_key
        stored = self.state.stateful_callbacks.pop(key, None)
        try:
            return super()._load_callback_state()
        finally:
            # the next save updates this entry in place, so it must exist, also in a plain Trainer's checkpoint
            self.state.stateful_callbacks[key] = stored if stored is not None else {}


def saved_callback_state(trainer_state: dict, name: str) -> dict | None:
    """The `attributes` a callback's `ExportableState.state()` saved in a checkpoint's `trainer_state.json`
    (`TrainerState.stateful_callbacks[name]`, a list where several callbacks of one class were saved: the first)."""
    entry = (trainer_state.get("stateful_callbacks") or {}).get(name)
    if isinstance(entry, list):
        entry = entry[0] if entry else None
    return entry.get("attributes") if isinstance(entry, dict) else None


def attention_implementation(model) -> str | None:
    """The model's attention implementation ("sdpa", "flex_attention", ...): its config's `_attn_implementation`,
    where transformers keeps the one in use (`attn_implementation` at loading sets it). `None` without a config."""
    config = getattr(getattr(model, "module", model), "config", None)  # (DDP wraps the model)
    return getattr(config, "_attn_implementation", None)


def forget_eval_dataloaders(trainer) -> None:
    """`Trainer.get_eval_dataloader` keeps the loaders it built under `dataloader_persistent_workers`
    (`_eval_dataloaders`); an eval batch that changed needs them built again."""
    kept = getattr(trainer, "_eval_dataloaders", None)
    if isinstance(kept, dict):
        kept.clear()


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


def sft_prepare_dataset(dataset, tokenizer, args, packing: bool, chat_template, completion_only_loss: bool):
    """The installed TRL's own preparation of a train dataset (chat template, EOS, truncation, packing), for
    `adaptive-batch plan`: `SFTTrainer._prepare_dataset` on a stand-in holding the three attributes it reads (TRL
    1.16), since no public function prepares a dataset without a model and a trainer."""
    import types

    from trl import SFTTrainer

    trainer = types.SimpleNamespace(
        _tokenizer=tokenizer, chat_template=chat_template, completion_only_loss=completion_only_loss
    )
    return SFTTrainer._prepare_dataset(trainer, dataset, tokenizer, args, packing, None, "train")


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
    """TRL's SFTTrainer counts tokens (`_total_train_tokens`) and appends metrics (`_metrics["train"]`, or
    `["eval"]`) on every `compute_loss` call. A step run again after an out-of-memory error would count them twice,
    and a row that adds nothing would count its tokens: keep the metrics of the last attempt only, and set the token
    count to the step's real tokens. An eval batch run in pieces appends once per piece: `merge` makes them one."""

    def __init__(self, trainer, mode: str = "train"):
        self.trainer = trainer
        metrics = getattr(trainer, "_metrics", None)
        self.lists = metrics.get(mode) if isinstance(metrics, dict) else None
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

    def merge(self, weights: list[float]) -> None:
        """Where each of the last `len(weights)` `compute_loss` calls appended one value to a list, make them one:
        their mean weighted by `weights` (TRL's entropy and token accuracy are means over a batch's label tokens, so
        with the pieces' label tokens as weights this is the whole batch's)."""
        total = sum(weights)
        if self.lists is None or total <= 0:
            return
        for key, values in self.lists.items():
            if len(values) - self.lengths.get(key, 0) == len(weights):
                appended = values[len(values) - len(weights) :]
                del values[len(values) - len(weights) :]
                values.append(sum(v * w for v, w in zip(appended, weights)) / total)

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


# -- torch ---------------------------------------------------------------------------------------------------------


def lambda_lr_state(scheduler, leave_out: tuple[str, ...]) -> dict:
    """A `LambdaLR` subclass's state as plain data: its `__dict__` without `leave_out` and without the flags torch's
    `LRScheduler` keeps about its own `get_lr` calls (`_get_lr_called_within_step`)."""
    return {
        key: value
        for key, value in scheduler.__dict__.items()
        if key not in leave_out and not key.startswith("_get_lr_called")
    }


# -- torch FSDP2 ---------------------------------------------------------------------------------------------------


def fsdp2_can_reset() -> bool:
    """Whether this torch's FSDP2 can undo a failed pass (`FSDPModule.reset_iter_state`: torch 2.13 has it, the
    GPU machine's 2.11 has not)."""
    from torch.distributed.fsdp import FSDPModule

    return hasattr(FSDPModule, "reset_iter_state")


def fsdp2_reset(model: torch.nn.Module) -> None:
    """Undo a forward or backward that an error cut short under FSDP2 (`fully_shard`): the root module's
    `reset_iter_state()` waits on in-flight collectives, reshards every parameter group and clears the iteration's
    trackers and its unreduced gradients."""
    model.reset_iter_state()


def is_fsdp2(trainer) -> bool:
    """Whether the Trainer's FSDP is FSDP2 (as `Trainer` itself tells: the Accelerator's `fsdp_plugin.fsdp_version`)."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    return getattr(plugin, "fsdp_version", 1) == 2


# -- DeepSpeed (through accelerate) --------------------------------------------------------------------------------

# DeepSpeed's switch that, set to false, hands the accumulation boundary to `engine.step()` (from 0.19.5): then
# `engine.backward` only accumulates, and `step()` does the boundary's work after the backward, overlapped with
# nothing (with offload: every gradient back to the GPU and out again). AdaptiveBatch keeps it true (the default) and
# marks the boundary per micro-batch instead.
MANAGED_ACCUMULATION = "managed_gradient_accumulation"


def deepspeed_config(trainer) -> dict:
    """The DeepSpeed config dict the engine will be built from (`DeepSpeedPlugin.deepspeed_config`, the same dict
    as `hf_ds_config.config`, filled from TrainingArguments where it says "auto")."""
    return trainer.accelerator.state.deepspeed_plugin.deepspeed_config


def deepspeed_engine(trainer):
    """The `DeepSpeedEngine` (built by `accelerator.prepare` when training starts)."""
    return trainer.accelerator.deepspeed_engine_wrapped.engine


@contextlib.contextmanager
def deepspeed_backward_only(trainer, boundary: bool) -> Iterator[None]:
    """Make `Accelerator.backward` mark the accumulation boundary (`boundary`: the step's last micro-batch) and run
    `engine.backward`, without the `engine.step()` that accelerate's `DeepSpeedEngineWrapper.backward` calls when
    `sync_gradients` is true: the step's end calls it, once every rank's micro-batches ran."""
    wrapper = trainer.accelerator.deepspeed_engine_wrapped

    def backward(loss, sync_gradients=True, **kwargs):
        wrapper.engine.set_gradient_accumulation_boundary(boundary)
        wrapper.engine.backward(loss, **kwargs)

    wrapper.backward = backward
    try:
        yield
    finally:
        del wrapper.backward  # the class's own method again


def deepspeed_reset(engine) -> None:
    """Undo a forward or backward that an error cut short, so that the step can run again from its start with every
    gradient gone. `zero_grad` alone is not enough: ZeRO-2 keeps the reduced gradients of earlier micro-batches in
    `all_grad_tensors`, and a backward cut short leaves a half-filled reduce bucket, "already reduced" flags and a
    backward depth behind (a retry asserts "has already been reduced"); ZeRO-3 keeps the parameters a forward
    gathered. tests/test_deepspeed.py checks it on DeepSpeed 0.19.8 with the error in the middle of a backward,
    under ZeRO-2 and 3, against a run without the error."""
    optimizer = engine.optimizer
    stage = engine.zero_optimization_stage()
    engine.zero_grad()  # first: ZeRO-3's optimizer.zero_grad fails on a CPU gradient still set
    optimizer.zero_grad(set_to_none=True)
    for name in ("all_grad_tensors", "averaged_gradients"):
        held = getattr(optimizer, name, None)
        if isinstance(held, dict):
            for key in held:
                held[key] = None
    for bucket in getattr(optimizer, "ipg_buckets", {}).values():
        if stage == 3:
            bucket.clear_params()  # `clear` would drop the buffer stage 3 allocates once
        else:
            bucket.clear()
            bucket.index = 0
    # with the optimizer offloaded, step() restores every parameter named here from its CPU buffer
    offloaded = getattr(optimizer, "_offload_accumulated_param_ids", None)
    if isinstance(offloaded, set):
        offloaded.clear()
    if isinstance(getattr(optimizer, "extra_large_param_to_reduce", None), dict):
        optimizer.extra_large_param_to_reduce.clear()
    if hasattr(optimizer, "_release_ipg_buffers"):
        optimizer._release_ipg_buffers()
    reduced = getattr(optimizer, "params_already_reduced", None)
    if reduced is not None:
        for key in reduced.keys() if isinstance(reduced, dict) else range(len(reduced)):
            reduced[key] = False
    if hasattr(optimizer, "_backward_hook_state"):
        optimizer._epilogue_ran_this_backward = False
        optimizer._backward_hook_state.reset_for_new_step()
    if hasattr(optimizer, "_backward_active_depth"):
        optimizer._backward_active_depth = 0
    if hasattr(optimizer, "micro_step_id"):
        # what step() leaves, so that the next backward is the step's first: ZeRO-3 counts from 0, ZeRO-1/2 from -1
        # (a backward adds one first). Left one higher, an offloaded backward adds the CPU buffers, which still hold
        # the failed attempt's gradients.
        optimizer.micro_step_id = 0 if stage == 3 else -1
    if callable(getattr(optimizer, "reset_cpu_buffers", None)) and getattr(optimizer, "cpu_offload", False):
        optimizer.reset_cpu_buffers()  # a boundary backward cut short: norms and the overflow flag it set
    engine.set_gradient_accumulation_boundary(False)
    if stage == 3:
        optimizer.empty_partition_cache()  # gives back the parameters the failed pass gathered
