"""Learning-rate rules: how the learning rate follows the effective batch, and the sample clock of the schedule.

The learning rate at step `k` is

    base_lr * base_schedule(virtual_step(k)) * rule(samples_in_step(k) / starting_effective_batch)

where `base_schedule` is the user's scheduler (warmup, decay, ...) built for `nominal_steps` steps of the starting
effective batch, and `virtual_step(k)` is where step `k` sits on that schedule when progress is counted in data:
the steps of the starting batch that the plain Trainer would have taken to reach the samples consumed before `k`
(each epoch's steps, its short last one counted as one, as the plain Trainer counts it, then the samples into the
current epoch over the starting batch). With a constant batch it is exactly `k`, as in the plain Trainer; when the
batch grows, warmup and decay keep their shape in data instead of stretching over the (now fewer) steps. The rule
applies to the samples the step actually holds: an epoch's short last step of 8 samples in a phase of 16 gets the
multiplier for 8.

Rules (Goyal et al. 2017 for linear/SGD; Malladi et al. 2022 for the square root with Adam-family optimizers):
- `"none"`: the learning rate does not follow the batch;
- `"sqrt"`: multiplied by `sqrt(B / B0)`, for Adam, AdamW and their 8-bit and paged variants;
- `"linear"`: multiplied by `B / B0`, for SGD;
- a callable `rule(effective_batch_size, starting_effective_batch_size) -> float`;
- `"gain"` and `"sqrt_gain"`, with `NoiseScaleSchedule` only: AdaScale's gain (Johnson et al. 2020)

      r = (B / B0) x (B_noise + B0) / (B_noise + B),

  in [1, B / B0]: the linear rule where the gradient noise dominates (B_noise >> B), no increase where it does not
  (a larger batch then does not buy a larger safe step). `"gain"` multiplies by r (SGD); `"sqrt_gain"` by sqrt(r)
  (Adam family: the square-root rule where noise dominates, Malladi et al. 2022, and less where it does not). B_noise
  is the noise scale measured when the schedule decided the change (fixed from then on, so that the learning rate of
  every step is known once its size is, and a resumed run recomputes it exactly); before the first change, and for
  steps smaller than the start (an epoch's short last step), B_noise counts as infinite: the plain linear or
  square-root rule. Unlike AdaScale, progress is still counted in samples: the budget does not shrink.

Pure Python: no torch, no transformers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .steps import StepPlan

LRRule = Callable[[int, int], float]
GAIN_POWERS = {"gain": 1.0, "sqrt_gain": 0.5}  # the power of AdaScale's gain each gain rule multiplies by
RULE_NAMES = ("none", "sqrt", "linear", *GAIN_POWERS)


def resolve_rule(rule: str | LRRule) -> LRRule:
    """Return the callable behind a rule name, or check and return a callable rule. (A gain rule's callable is its
    value at an infinite noise scale, the linear or square-root rule; `SampleClock` applies the gain.)"""
    if callable(rule):
        return rule
    if rule == "none":
        return lambda effective, starting: 1.0
    if rule in ("sqrt", "sqrt_gain"):
        return lambda effective, starting: math.sqrt(effective / starting)
    if rule in ("linear", "gain"):
        return lambda effective, starting: effective / starting
    raise ValueError(
        f"lr_scaling={rule!r} is not one of {RULE_NAMES} or a callable rule(effective, starting) -> float; use "
        "'sqrt' for Adam-family optimizers, 'linear' for SGD, 'none' to leave the learning rate alone."
    )


def gain_power(rule: str | LRRule) -> float | None:
    """The power of AdaScale's gain a rule multiplies by (1 for "gain", 1/2 for "sqrt_gain"); `None` for the
    others."""
    return GAIN_POWERS.get(rule) if isinstance(rule, str) else None


def gain(effective_batch_size: int, starting_effective_batch_size: int, noise_scale: float) -> float:
    """AdaScale's gain r = (B / B0)(B_noise + B0) / (B_noise + B); B / B0 at an infinite (or unknown) noise scale.

    Example: `gain(64, 16, 48)` = 4 x 64 / 112 = 2.29: four times the samples buy 2.29 times the step.
    """
    ratio = effective_batch_size / starting_effective_batch_size
    if math.isinf(noise_scale) or effective_batch_size <= starting_effective_batch_size:
        return ratio
    noise_scale = max(noise_scale, 0.0)
    return ratio * (noise_scale + starting_effective_batch_size) / (noise_scale + effective_batch_size)


def lr_scale(rule: LRRule, effective_batch_size: int, starting_effective_batch_size: int) -> float:
    """The multiplier of the learning rate at `effective_batch_size`; checked to be positive and finite."""
    scale = rule(effective_batch_size, starting_effective_batch_size)
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not math.isfinite(scale)
        or scale <= 0
    ):
        raise ValueError(
            f"lr_scaling rule gave {scale!r} for effective batch {effective_batch_size} (starting "
            f"{starting_effective_batch_size}); it must return a positive finite float."
        )
    return float(scale)


@dataclass
class SampleClock:
    """Maps optimizer steps of a [`StepPlan`] to positions on the base LR schedule and LR multipliers.

    Attributes:
        plan: the step plan (a growing schedule replaces it).
        rule: a resolved LR rule.
        starting_effective_batch_size: `B0`, the effective batch the rule is relative to.
        nominal_steps: the length the base schedule is built for: the budget in steps of `B0`, as the plain Trainer
            counts them.
        steps_per_epoch: the plain Trainer's steps in one epoch at `B0` (its short last step among them); `None`
            for a stream, which has no epochs.

    Gain rules (`gain_power`, see the module docstring) also take `noise_scale_at(step)`: the noise scale the
    schedule decided the size of `step` on.
    """

    plan: StepPlan
    rule: LRRule
    starting_effective_batch_size: int
    nominal_steps: int
    steps_per_epoch: int | None = None
    gain_power: float | None = None
    noise_scale_at: Callable[[int], float] | None = None

    def virtual_step(self, step: int) -> float:
        """Position of `step` on the base schedule: the steps of `B0` the data consumed before it takes (see the
        module docstring). Whole numbers stay exact, so it is exactly `step` whenever the batch is constant.

        Example: 60 samples an epoch at B0 = 8 are 8 steps (the last of 4); the step starting 16 samples into the
        second epoch sits at 8 + 16 / 8 = 10.
        """
        if step >= self.plan.num_steps:
            return float(self.nominal_steps)
        position, starting = self.plan.starts[step], self.starting_effective_batch_size
        if self.steps_per_epoch is None:  # a stream: one pass, no epoch ends
            return position / starting
        epochs, offset = divmod(position, self.plan.dataset_size)
        return epochs * self.steps_per_epoch + min(offset / starting, self.steps_per_epoch)

    def scale(self, step: int) -> float:
        """The LR multiplier at `step`, for the samples it holds; after the last step, the last step's."""
        plan = self.plan
        step = min(step, plan.num_steps - 1)
        # steps trained before the plan took over (a plain Trainer's checkpoint) ran at their scheduled batch
        samples = plan.sizes[step] if step >= plan.done_steps else plan.scheduled[step]
        if self.gain_power is not None and self.noise_scale_at is not None:
            noise_scale = self.noise_scale_at(step)
            return gain(samples, self.starting_effective_batch_size, noise_scale) ** self.gain_power
        return self.multiplier(samples)

    def multiplier(self, samples: int) -> float:
        """The LR multiplier of a step holding `samples`."""
        return lr_scale(self.rule, samples, self.starting_effective_batch_size)

    def check(self) -> None:
        """Evaluate the rule at every step size of the plan, so that a bad rule fails before any compute."""
        for samples in sorted(set(self.plan.sizes[self.plan.done_steps :])):
            self.multiplier(samples)
