"""Data epochs as the Trainer's own epochs: the loop, told of one epoch of every planned step (its step counts vary
with the batch), runs the Trainer's `_run_epoch` once per data epoch, so that `on_epoch_begin`, `on_epoch_end` and the
epoch-strategy logging, evaluation and saving after it come where and as the plain Trainer sends them."""

from __future__ import annotations

from collections.abc import Iterator

from ..core.steps import StepPlan


def epoch_steps(plan: StepPlan, step: int) -> range:
    """The optimizer steps of the data epoch `step` belongs to (a step never spans two epochs)."""
    epoch, first, last = plan.epoch(step), step, step
    while first > 0 and plan.epoch(first - 1) == epoch:
        first -= 1
    while last + 1 < plan.num_steps and plan.epoch(last + 1) == epoch:
        last += 1
    return range(first, last + 1)


def data_epochs(state, session, resumed: bool) -> Iterator[dict]:
    """The loop's arguments of `_run_epoch` for each data epoch left in the plan, each computed when the one before
    has run (a batch that grows mid-epoch replans the rest).

    A resumed run starts inside the epoch of its next step, its steps before skipped as the Trainer skips them; the
    RNG state is restored as the plain Trainer restores it (at that epoch's start, or after the skip). A batch that
    grows mid-epoch ends the epoch's data sooner: its sampler stops there and the loop's remaining iterations draw
    nothing."""
    first, resumed_epoch = True, None
    while state.global_step < session.plan.num_steps:
        plan, step = session.plan, state.global_step
        steps, epoch = epoch_steps(plan, step), plan.epoch(step)
        if first and resumed:
            resumed_epoch = epoch
        # (a stream is one epoch; the Trainer's own `set_epoch` call misses the sampler behind a resume's skip)
        if hasattr(session.sampler, "set_epoch"):
            session.sampler.set_epoch(epoch)
        done_in_epoch = range(steps.start, step) if first else range(0)
        yield {
            "epoch": epoch,
            "steps_in_epoch": sum(map(session.slots, steps)),  # (the loop's batches)
            "num_update_steps_per_epoch": len(steps),
            "epochs_trained": resumed_epoch if resumed_epoch is not None else 0,
            "steps_trained_in_current_epoch": sum(map(session.slots, done_in_epoch)),
        }
        first = False
        if state.global_step == step:
            return  # (an epoch that drew nothing: the Trainer's own warning said so)
