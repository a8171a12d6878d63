"""The setups AdaptiveBatch refuses before any compute, each with one error naming the value, the rule and a fix."""

from __future__ import annotations

from transformers import Trainer

from ..runtime.compat.trainer import REPLACED_DATA_METHODS, user_class
from ..runtime.stream import is_stream


def check_trainer(trainer: Trainer) -> None:
    args = trainer.args
    if args.auto_find_batch_size:
        raise ValueError(
            "auto_find_batch_size=True restarts the training loop on OOM and silently changes the effective batch; "
            "AdaptiveBatch finds the micro-batch inside each step and keeps the effective batch. Set "
            "auto_find_batch_size=False."
        )
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)  # none stated: version 1
    if getattr(trainer, "is_fsdp_enabled", False) and getattr(plugin, "fsdp_version", 1) != 2:
        raise ValueError(
            "FSDP version 1 is not supported: it accumulates gradients unsharded outside no_sync and cannot undo "
            "a failed micro-batch. Use FSDP2 (torch's fully_shard): fsdp_config={'version': 2} in "
            "TrainingArguments (the default), or fsdp_version: 2 in the accelerate config."
        )
    parallelism = getattr(trainer.accelerator, "parallelism_config", None)
    if parallelism is not None and getattr(parallelism, "non_data_parallel_size", 1) > 1:
        raise ValueError(
            "Tensor, context or sequence parallelism give ranks the same samples; AdaptiveBatch splits samples "
            "across all ranks. Use data parallelism only, or remove AdaptiveBatch."
        )
    if args.n_gpu > 1:
        raise ValueError(
            f"{args.n_gpu} GPUs in one process (torch.nn.DataParallel) are not supported: launch one process per "
            "GPU with torchrun or accelerate launch, or set CUDA_VISIBLE_DEVICES to one GPU."
        )
    accelerate = args.accelerator_config
    if getattr(accelerate, "dispatch_batches", None) or getattr(accelerate, "split_batches", False):
        raise ValueError(
            "accelerator_config dispatch_batches/split_batches change who loads which samples; AdaptiveBatch gives "
            "every rank its own share of each step. Leave both unset."
        )
    if args.train_sampling_strategy not in ("random", "sequential"):
        raise ValueError(
            f"train_sampling_strategy={args.train_sampling_strategy!r}: AdaptiveBatch orders samples itself and "
            "groups each step's samples by length before cutting micro-batches. Use 'random' (or 'sequential')."
        )
    for method in REPLACED_DATA_METHODS:
        owner = user_class(trainer, method)
        if owner is not Trainer:
            raise ValueError(
                f"{owner.__name__} overrides {method}, which AdaptiveBatch replaces with its step sampler, so your "
                "version would be skipped. Move that logic into the dataset or data collator, or remove AdaptiveBatch."
            )
    dataset = trainer.train_dataset
    if dataset is not None and is_stream(dataset) and args.max_steps <= 0:
        raise ValueError(
            f"The training dataset ({type(dataset).__name__}) is a stream, with no length to count epochs in, "
            f"and max_steps={args.max_steps}. Set max_steps: AdaptiveBatch then reads max_steps x the starting "
            "effective batch samples from it, once, in order."
        )
