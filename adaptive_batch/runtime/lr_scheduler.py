"""The user's learning-rate scheduler, driven by the sample clock and scaled by the LR rule."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR

from ..core.lr import SampleClock
from .compat.torch import lambda_lr_state


class SampleClockLR(LambdaLR):
    """A `LambdaLR` giving, at step `k`, `base_lr * base_lambda(clock.virtual_step(k)) * clock.scale(k)`; its state
    is plain data in `LambdaLR`'s layout, so a plain Trainer can resume it."""

    def __init__(self, optimizer: torch.optim.Optimizer, base_lambdas: list[Callable], clock: SampleClock):
        self.clock = clock
        super().__init__(optimizer, [_Clocked(fn, clock) for fn in base_lambdas])

    def state_dict(self) -> dict:
        state = lambda_lr_state(self, leave_out=("optimizer", "lr_lambdas", "clock"))
        # as LambdaLR writes plain functions' state, so that a plain Trainer can load it and go on from this step
        state["lr_lambdas"] = [None] * len(self.lr_lambdas)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        self.__dict__.update({key: value for key, value in state_dict.items() if key != "lr_lambdas"})


class _Clocked:
    """A base schedule's factor read at the clock's place, times the LR rule's; the base's own attributes (a
    `functools.partial`'s `func` and `keywords`) stay readable through it."""

    def __init__(self, base_lambda: Callable[[float], float], clock: SampleClock):
        self.base_lambda, self.clock = base_lambda, clock

    def __call__(self, step: int) -> float:
        return self.base_lambda(self.clock.virtual_step(step)) * self.clock.scale(step)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.base_lambda, name)


def follow_sample_clock(
    scheduler, optimizer: torch.optim.Optimizer, clock: SampleClock, batch_changes: bool
) -> SampleClockLR | object:
    """Make a `LambdaLR` follow the sample clock and the LR rule where the batch changes; the scheduler itself where
    it does not (the clock is then the step count: the Trainer's own object, class and attributes)."""
    if isinstance(scheduler, SampleClockLR) or not batch_changes:
        return scheduler
    # (a subclass with its own `get_lr`, such as Adafactor's relative-step schedule, does not read its lambdas)
    if isinstance(scheduler, LambdaLR) and type(scheduler).get_lr is LambdaLR.get_lr:
        return SampleClockLR(optimizer, list(scheduler.lr_lambdas), clock)
    raise ValueError(
        f"The learning-rate scheduler {type(scheduler).__name__} cannot follow a changing effective batch: "
        "AdaptiveBatch evaluates the schedule at the fraction of the sample budget consumed and scales it by the "
        "LR rule, which needs a LambdaLR that computes its LR from its lambdas (not a subclass with its own get_lr, "
        "as Adafactor's relative-step AdafactorSchedule). Use an lr_scheduler_type such as 'linear', 'cosine' or "
        "'constant_with_warmup' (or pass a LambdaLR), or keep the effective batch constant with lr_scaling='none'."
    )
