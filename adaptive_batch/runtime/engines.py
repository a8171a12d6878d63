"""What each training engine needs around the micro-batches of a step, one [`Engine`] per engine; an out-of-memory
error is not retried where a backward holds collectives (a hang). See docs/how-it-works.md, "Several processes"."""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist

from .compat.deepspeed import MANAGED_ACCUMULATION, deepspeed_backward_only, deepspeed_reset
from .compat.torch import ddp_forget_forward

logger = logging.getLogger("adaptive_batch")


class EngineOutOfMemoryError(RuntimeError):
    """A micro-batch ran out of memory under an engine where a retry cannot be made safe."""


class Engine:
    """What the step runner asks of an engine, done as one process without one does it (`.grad` zeroed to forget)."""

    name = "one process"
    retries = True  # an out-of-memory error can be retried
    no_retry_because: str | None = None  # where `retries` is False for another reason than collectives
    measures_noise = True  # each micro-batch's own gradient reaches the parameters' hooks ([`noise_hooks`])
    model_placed_before_train = (
        True  # the Trainer's model runs on its device before train() (a check may use it)
    )

    def micro_batch(self, model: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def finish_step(self, model: torch.nn.Module) -> None:
        pass

    def forget(self, model: torch.nn.Module, optimizer) -> None:
        model.zero_grad(set_to_none=True)
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)

    def out_of_memory(self, error: BaseException, world_size: int) -> EngineOutOfMemoryError:
        why = self.no_retry_because or (
            "its forward and backward passes hold collectives that the other ranks are already waiting in, so the "
            "step cannot be run again smaller on every rank"
        )
        return EngineOutOfMemoryError(
            f"Out of memory in a micro-batch under {self.name} with {world_size} "
            f"process{'es' if world_size != 1 else ''}: {why}. Choose a micro-batch that fits before the run: run "
            "`adaptive-batch probe` for this model and sequence length on one GPU and pass its size as "
            f"AdaptiveBatch(micro_batch_size=N) (or max_micro_batch_size=N). The error was: {error}"
        )


class SingleProcess(Engine):
    """One process, no engine."""


class DataParallel(Engine):
    """DDP (or several processes without a wrapper): every micro-batch under `no_sync`, then one average over the
    ranks ([`average_gradients`]). Not DDP's reducer for the last one: an OOM amid its in-backward bucket
    all-reduces would mismatch the ranks' next collective (a hang or a wrong gradient)."""

    name = "DDP"

    def __init__(self, trainer, world_size: int):
        self.trainer, self.world_size = trainer, world_size

    def micro_batch(self, model, last):
        return self.trainer.accelerator.no_sync(model)  # gradients local until the step's single reduction

    def finish_step(self, model) -> None:
        average_gradients(model, self.world_size)
        broadcast_buffers(model)

    def forget(self, model, optimizer) -> None:
        super().forget(model, optimizer)
        ddp_forget_forward(model)


class FullyShardedV2(Engine):
    """FSDP2: micro-batches reduce-scatter into the sharded `.grad`; `reset_iter_state` undoes a failed attempt."""

    name = "FSDP2"
    measures_noise = False  # the hooks would see the sharded gradient, already averaged over the ranks
    model_placed_before_train = False  # sharded and moved in train()

    def __init__(self, world_size: int):
        self.retries = world_size == 1
        from torch.distributed.fsdp import FSDPModule

        if self.retries and not hasattr(FSDPModule, "reset_iter_state"):  # torch 2.13 has it, 2.11 not
            self.retries = False
            why = f"torch {torch.__version__} has no FSDPModule.reset_iter_state to undo the failed pass"
            self.no_retry_because = f"{why} (torch 2.13 has it)"

    def forget(self, model, optimizer) -> None:
        model.reset_iter_state()  # the root module's: waits on in-flight collectives, reshards, clears the pass
        super().forget(model, optimizer)


class DeepSpeed(Engine):
    """DeepSpeed ZeRO-0 to 3 through accelerate: each micro-batch runs `engine.backward` alone, the last marked as
    the accumulation boundary; the step's end runs `engine.step()` once."""

    name = "DeepSpeed"
    measures_noise = False  # ZeRO reduces and partitions the gradients the hooks would read
    model_placed_before_train = False  # the engine is built (and ZeRO-3 gathers parameters) in train()

    def __init__(self, trainer, world_size: int):
        self.trainer = trainer
        self.retries = world_size == 1

    def micro_batch(self, model, last):
        return deepspeed_backward_only(self.trainer, boundary=last)

    def finish_step(self, model) -> None:
        self.trainer.accelerator.deepspeed_engine_wrapped.engine.step()

    def forget(self, model, optimizer) -> None:
        deepspeed_reset(self.trainer.accelerator.deepspeed_engine_wrapped.engine)


def prepare(trainer) -> None:
    """Before the Trainer builds DeepSpeed's engine: refuse a setup AdaptiveBatch cannot drive, fix its boundary."""
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return
    import deepspeed
    from packaging.version import Version

    if Version(deepspeed.__version__) < Version("0.19.5"):
        raise ValueError(
            f"DeepSpeed {deepspeed.__version__} is older than AdaptiveBatch supports: undoing a failed attempt at a "
            "step reads ZeRO's state as DeepSpeed 0.19.5 and later keep it (tested on 0.19.8). Upgrade: "
            "pip install 'adaptive-batch[deepspeed]' (deepspeed>=0.19.5)."
        )
    # (the dict the engine will be built from, "auto" filled from TrainingArguments)
    config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
    if "scheduler" in config:
        raise ValueError(
            f"The DeepSpeed config has a scheduler ({config['scheduler'].get('type')!r}), which DeepSpeed steps by "
            "optimizer steps; AdaptiveBatch drives the learning rate by samples through the Trainer's scheduler. "
            "Remove the scheduler section and set lr_scheduler_type (and warmup_steps) in TrainingArguments."
        )
    if config.get(MANAGED_ACCUMULATION) is False:
        config[MANAGED_ACCUMULATION] = True
        logger.warning(
            f"DeepSpeed: {MANAGED_ACCUMULATION}: false in the config is set to true: AdaptiveBatch marks each step's "
            "last micro-batch as the accumulation boundary, so that its backward does the boundary's work."
        )
    logger.info(
        "DeepSpeed: AdaptiveBatch marks each step's accumulation boundary; the config's batch fields "
        "(train_micro_batch_size_per_gpu, gradient_accumulation_steps) are only logged by DeepSpeed."
    )


def engine_for(trainer, world_size: int) -> Engine:
    """The engine the Trainer trains with ([`checks.check_trainer`] refused the ones not listed)."""
    if getattr(trainer, "is_deepspeed_enabled", False):
        return DeepSpeed(trainer, world_size)
    if getattr(trainer, "is_fsdp_enabled", False):
        return FullyShardedV2(world_size)
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        return DataParallel(trainer, world_size)
    return SingleProcess()


def average_gradients(model: torch.nn.Module, world_size: int, bucket_bytes: int = 64 << 20) -> None:
    """Average the trainable parameters' gradients over the ranks, as DDP's reducer does; one no rank made keeps
    `grad=None` (as under `find_unused_parameters`), one some ranks made is averaged with zeros."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return
    # which parameters have a gradient on some rank: one small all-reduce (DDP with find_unused_parameters
    # all-reduces its `local_used_map` likewise)
    used = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8, device=params[0].device)
    dist.all_reduce(used, op=dist.ReduceOp.MAX)
    params = [p for p, on_some_rank in zip(params, used.tolist(), strict=True) if on_some_rank]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets: dict[tuple, list[list[torch.nn.Parameter]]] = {}  # by dtype and device, of about `bucket_bytes`
    filled: dict[tuple, int] = {}
    for p in params:
        key = (p.grad.dtype, p.grad.device)
        if filled.get(key, bucket_bytes) >= bucket_bytes:
            buckets.setdefault(key, []).append([])
            filled[key] = 0
        buckets[key][-1].append(p)
        filled[key] += p.grad.numel() * p.grad.element_size()
    for bucket in (bucket for lists in buckets.values() for bucket in lists):
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        # torch 2.13's reducer (no comm hook, `batched_grad_copy=False`) multiplies each gradient by 1 / world_size
        # as it copies it into its bucket, then sums: so here too (on 3 gloo ranks this is DDP's gradient bit for
        # bit, the sum then a division is not). With more than 2 ranks the sum's order follows the bucket layout.
        flat.mul_(1.0 / world_size)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        for p, part in zip(bucket, flat.split([p.grad.numel() for p in bucket])):
            p.grad.copy_(part.view_as(p.grad))


def broadcast_buffers(model: torch.nn.Module) -> None:
    """Give every rank rank 0's buffers, as DDP does before a forward that follows a synchronised backward."""
    if not getattr(model, "broadcast_buffers", False):
        return
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
