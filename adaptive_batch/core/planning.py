"""Planning a run before it starts, for `train()` and `adaptive-batch plan` alike ([`plan_run`]): the budget in
samples, the step plan and the LR's sample clock (docs/how-it-works.md, "Plan"). Pure Python."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .lr import LRRule, SampleClock, gain_power, resolve_rule
from .plain_trainer import PlainBatching
from .schedule import ConstantSchedule, Progress, Schedule, check_effective_batch_size
from .steps import Budget, DoneSteps, StepPlan, build_plan


@dataclass(frozen=True)
class RunSettings:
    """What a run's plan depends on besides its schedule, from the Trainer's arguments (`dataset_size` `None`: a
    stream); the batch settings tell how the plain Trainer cuts an epoch ([`plain_trainer`])."""

    dataset_size: int | None
    num_train_epochs: float = 3.0
    max_steps: int = -1
    world_size: int = 1
    drop_last: bool = False
    unit: str = "samples"
    per_device_train_batch_size: int | None = None
    gradient_accumulation_steps: int = 1

    @property
    def users_batch(self) -> int | None:
        """`per_device_train_batch_size x gradient_accumulation_steps x world_size` (`None`: not told)."""
        if self.per_device_train_batch_size is None:
            return None
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size

    def plain_trainer(self, starting_effective_batch_size: int) -> PlainBatching | None:
        if self.dataset_size is None:
            return None
        per_device, accumulation = self.per_device_train_batch_size, self.gradient_accumulation_steps
        if self.users_batch != starting_effective_batch_size:  # (None where the per-device size is not told)
            per_device, accumulation = max(1, starting_effective_batch_size // self.world_size), 1
        return PlainBatching(self.dataset_size, per_device, accumulation, self.world_size, self.drop_last)


@dataclass
class RunPlan:
    """A run's budget, step plan and sample clock; a schedule that grows plans the rest again ([`replan`])."""

    settings: RunSettings
    budget: Budget
    dataset_size: int
    plan: StepPlan
    clock: SampleClock
    done: DoneSteps | None

    @property
    def starting_effective_batch_size(self) -> int:
        return self.clock.starting_effective_batch_size

    def replan(self, schedule: Schedule) -> StepPlan:
        s = self.settings
        self.plan = self.clock.plan = build_plan(
            schedule, self.dataset_size, self.budget, s.world_size, s.drop_last, done=self.done, unit=s.unit
        )
        return self.plan


def plan_run(
    schedule: Schedule,
    settings: RunSettings,
    lr_scaling: str | LRRule = "none",
    done: DoneSteps | None = None,
    noise_scale_at: Callable[[int], float] | None = None,
) -> RunPlan:
    """Plan a run: its budget in samples, its steps and the LR's clock; every refusal happens here, before any
    compute. `done`: steps a plain Trainer's checkpoint trained; `noise_scale_at`: for the gain LR rules."""
    starting = check_effective_batch_size(schedule(Progress(0, 0, 0.0)), where="The schedule at step 0")
    plain = settings.plain_trainer(starting)
    budget, nominal = _budget(settings, starting, plain)
    dataset_size = budget.samples if settings.dataset_size is None else settings.dataset_size
    plan = build_plan(
        schedule,
        dataset_size,
        budget,
        settings.world_size,
        settings.drop_last,
        done=done,
        unit=settings.unit,
        plain_batches=_plain_batches(schedule, settings, starting, plain),
    )
    clock = SampleClock(
        plan,
        resolve_rule(lr_scaling),
        starting,
        nominal,
        steps_per_epoch=plain.steps_per_epoch if plain is not None else None,
        gain_power=gain_power(lr_scaling),
        noise_scale_at=noise_scale_at,
    )
    clock.check()
    return RunPlan(settings, budget, dataset_size, plan, clock, done)


def _plain_batches(
    schedule: Schedule, settings: RunSettings, starting: int, plain: PlainBatching | None
) -> tuple[int, int] | None:
    """Where the steps are the plain Trainer's (the user's own batch, constant; not a stream), its batches' samples
    over all ranks and its batches an epoch on each rank."""
    if plain is None or not isinstance(schedule, ConstantSchedule) or settings.users_batch != starting:
        return None
    return plain.per_device_train_batch_size * plain.world_size, plain.batches_per_epoch


def _budget(settings: RunSettings, starting: int, plain: PlainBatching | None) -> tuple[Budget, int]:
    """The budget in samples and the plain Trainer's steps at `starting` that take it (the LR schedule's length)."""
    if plain is None:  # a stream: max_steps steps of the starting batch, read once
        if settings.max_steps <= 0:
            raise ValueError(
                f"A stream has no epochs to count: plan it by max_steps > 0, not {settings.max_steps}."
            )
        return Budget.from_max_steps(settings.max_steps, starting), settings.max_steps
    if settings.max_steps > 0:
        steps = settings.max_steps
        origin = (
            f"max_steps={steps:,} steps of the plain Trainer at the starting effective batch {starting:,} (an "
            "epoch's short last step counts as one; a growing batch takes the same samples in fewer steps, a "
            "shrinking one in more; num_train_epochs is ignored, as in the Trainer)"
        )
    else:
        # (refuses a budget of no epochs)
        origin = Budget.from_epochs(settings.num_train_epochs, plain.dataset_size).origin
        steps = plain.total_steps(settings.num_train_epochs)
    return Budget(plain.position_after(steps), origin), steps
