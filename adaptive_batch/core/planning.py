"""Planning a run before it starts: the budget in samples, the step plan and the sample clock of the learning rate.

One function, [`plan_run`], used by the Trainer wiring when `train()` starts and by `adaptive-batch plan`, so the
command prints exactly what the run will do.

Pure Python: no torch, no transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .lr import LRRule, SampleClock, gain_power, nominal_steps, resolve_rule
from .schedule import Progress, Schedule, check_effective_batch_size
from .steps import Budget, DoneSteps, StepPlan, build_plan


@dataclass(frozen=True)
class RunSettings:
    """What a run's plan depends on besides its schedule, as the Trainer's arguments give it.

    Attributes:
        dataset_size: rows of the training dataset; `None` for a stream (one pass over the budget, in order).
        num_train_epochs: the budget in epochs, where `max_steps` is not set.
        max_steps: the budget in steps of the starting effective batch where > 0 (it wins, as in the Trainer).
        world_size: data-parallel processes.
        drop_last: `dataloader_drop_last`: an epoch's short last step is dropped.
        unit: what one dataset row is, for messages ("packed rows" under TRL's packing).
    """

    dataset_size: int | None
    num_train_epochs: float = 3.0
    max_steps: int = -1
    world_size: int = 1
    drop_last: bool = False
    unit: str = "samples"


@dataclass
class RunPlan:
    """A run's budget, step plan and sample clock. A schedule that grows during training plans the steps again
    ([`replan`]); the budget and the steps already done stay."""

    settings: RunSettings
    budget: Budget
    dataset_size: int
    plan: StepPlan
    clock: SampleClock
    done: DoneSteps | None

    @property
    def starting_effective_batch_size(self) -> int:
        return self.clock.starting_effective_batch_size

    def steps(self, schedule: Schedule) -> StepPlan:
        """The step plan `schedule` gives over this run's budget (from where the done steps ended)."""
        settings = self.settings
        return build_plan(
            schedule,
            self.dataset_size,
            self.budget,
            settings.world_size,
            settings.drop_last,
            done=self.done,
            unit=settings.unit,
        )

    def replan(self, schedule: Schedule) -> StepPlan:
        """Plan the steps again under `schedule` and make the clock follow the new plan."""
        self.plan = self.clock.plan = self.steps(schedule)
        return self.plan


def plan_run(
    schedule: Schedule,
    settings: RunSettings,
    lr_scaling: str | LRRule = "none",
    done: DoneSteps | None = None,
    noise_scale_at: Callable[[int], float] | None = None,
) -> RunPlan:
    """Plan a run: its budget in samples, its steps and the learning rate's clock. Every refusal (a bad schedule, a
    budget that leaves no step, a rule that gives no valid multiplier) happens here, before any compute.

    Args:
        schedule: the effective batch over training.
        settings: the dataset and the Trainer's budget.
        lr_scaling: the LR rule (a name or a callable).
        done: steps trained before the plan takes over (a plain Trainer's checkpoint).
        noise_scale_at: for the gain rules, the noise scale the size of a step was decided on.

    Example:
        ```python
        run = plan_run(PhaseSchedule([8, 16], [0.5]), RunSettings(dataset_size=1000, num_train_epochs=1), "sqrt")
        run.plan.num_steps  # 94: 63 steps of 8 (the last of 4), then 31 of 16 and one of 4
        ```
    """
    starting = check_effective_batch_size(schedule(Progress(0, 0, 0.0)), where="The schedule at step 0")
    if settings.max_steps > 0:
        budget = Budget.from_max_steps(settings.max_steps, starting)
    elif settings.dataset_size is None:
        raise ValueError(
            f"A stream has no epochs to count: plan it by max_steps > 0, not {settings.max_steps}."
        )
    else:
        budget = Budget.from_epochs(settings.num_train_epochs, settings.dataset_size)
    dataset_size = budget.samples if settings.dataset_size is None else settings.dataset_size
    plan = build_plan(
        schedule, dataset_size, budget, settings.world_size, settings.drop_last, done=done, unit=settings.unit
    )
    clock = SampleClock(
        plan,
        resolve_rule(lr_scaling),
        starting,
        nominal_steps(budget.samples, starting),
        gain_power=gain_power(lr_scaling),
        noise_scale_at=noise_scale_at,
    )
    clock.check()
    return RunPlan(settings, budget, dataset_size, plan, clock, done)
