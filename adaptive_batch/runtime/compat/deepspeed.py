"""DeepSpeed: the accumulation boundary set per micro-batch, and the ZeRO state a failed pass leaves, undone."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

# DeepSpeed's switch (from 0.19.5) that, set to false, moves the accumulation boundary's work into `engine.step()`,
# after the backward and overlapped with nothing; AdaptiveBatch keeps it true and marks the boundary per micro-batch.
MANAGED_ACCUMULATION = "managed_gradient_accumulation"


@contextlib.contextmanager
def deepspeed_backward_only(trainer, boundary: bool) -> Iterator[None]:
    """Make `Accelerator.backward` mark the accumulation boundary and skip the `engine.step()` accelerate's wrapper
    adds (the step's end calls it): it has no switch, so its method is replaced on the instance."""
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
    """Undo a forward or backward an error cut short, every gradient gone: DeepSpeed has no public reset; `zero_grad`
    leaves ZeRO-2's reduced gradients, buckets and flags, ZeRO-3's gathered parameters (tests/test_deepspeed.py)."""
    optimizer = engine.optimizer
    stage = engine.zero_optimization_stage()
    engine.zero_grad()  # first: ZeRO-3's optimizer.zero_grad fails on a CPU gradient still set
    optimizer.zero_grad(set_to_none=True)
    for name in ("all_grad_tensors", "averaged_gradients"):  # ZeRO-2's gradients of earlier micro-batches
        held = getattr(optimizer, name, None)
        if isinstance(held, dict):
            for key in held:
                held[key] = None
    for bucket in getattr(optimizer, "ipg_buckets", {}).values():  # the half-filled reduce buckets
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
    if hasattr(optimizer, "_release_ipg_buffers"):  # the bucket's buffers
        optimizer._release_ipg_buffers()
    reduced = getattr(optimizer, "params_already_reduced", None)  # else a retry asserts "already reduced"
    if reduced is not None:
        for key in reduced.keys() if isinstance(reduced, dict) else range(len(reduced)):
            reduced[key] = False
    if hasattr(optimizer, "_backward_hook_state"):  # the epilogue a backward cut short did not run
        optimizer._epilogue_ran_this_backward = False
        optimizer._backward_hook_state.reset_for_new_step()
    if hasattr(optimizer, "_backward_active_depth"):  # the backward cut short is still counted as running
        optimizer._backward_active_depth = 0
    if hasattr(optimizer, "micro_step_id"):
        # what step() leaves, so that the next backward is the step's first (ZeRO-3 counts from 0, ZeRO-1/2 from -1):
        # left one higher, an offloaded backward adds the CPU buffers, which still hold the failed attempt's gradients
        optimizer.micro_step_id = 0 if stage == 3 else -1
    if callable(getattr(optimizer, "reset_cpu_buffers", None)) and getattr(optimizer, "cpu_offload", False):
        optimizer.reset_cpu_buffers()  # a boundary backward cut short: norms and the overflow flag it set
    engine.set_gradient_accumulation_boundary(False)
    if stage == 3:
        optimizer.empty_partition_cache()  # gives back the parameters the failed pass gathered
