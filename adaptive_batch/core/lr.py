"""Learning-rate rules on the sample clock: the LR at step `k` is `base_lr x base_schedule(virtual_step(k)) x
rule(samples_in_step(k) / B0)`. Rules: "none", "sqrt" (Malladi et al. 2022), "linear" (Goyal et al. 2017), a callable,
and AdaScale's "gain" / "sqrt_gain". See docs/how-it-works.md, "A learning rate that follows the gain". Pure Python."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .steps import StepPlan

LRRule = Callable[[int, int], float]
GAIN_POWERS = {"gain": 1.0, "sqrt_gain": 0.5}  # the power of AdaScale's gain each gain rule multiplies by
RULE_NAMES = ("none", "sqrt", "linear", *GAIN_POWERS)


def resolve_rule(rule: str | LRRule) -> LRRule:
    """The callable behind a rule name (a gain rule's at an infinite noise scale), or the callable given."""
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
    """The power of AdaScale's gain a rule multiplies by (1: "gain", 1/2: "sqrt_gain"); `None` for the others."""
    return GAIN_POWERS.get(rule) if isinstance(rule, str) else None


def gain(effective_batch_size: int, starting_effective_batch_size: int, noise_scale: float) -> float:
    """AdaScale's gain r = (B / B0)(B_noise + B0) / (B_noise + B); B / B0 at an infinite (or unknown) noise scale."""
    ratio = effective_batch_size / starting_effective_batch_size
    if math.isinf(noise_scale) or effective_batch_size <= starting_effective_batch_size:
        return ratio
    noise_scale = max(noise_scale, 0.0)
    return ratio * (noise_scale + starting_effective_batch_size) / (noise_scale + effective_batch_size)


def lr_scale(rule: LRRule, effective_batch_size: int, starting_effective_batch_size: int) -> float:
    scale = rule(effective_batch_size, starting_effective_batch_size)
    number = isinstance(scale, (int, float)) and not isinstance(scale, bool)
    if not number or not math.isfinite(scale) or scale <= 0:
        raise ValueError(
            f"lr_scaling rule gave {scale!r} for effective batch {effective_batch_size} (starting "
            f"{starting_effective_batch_size}); it must return a positive finite float."
        )
    return float(scale)


@dataclass
class SampleClock:
    """Maps optimizer steps of a [`StepPlan`] to positions on the base LR schedule (built for `nominal_steps` of the
    starting batch B0) and to LR multipliers; `steps_per_epoch` is the plain Trainer's at B0 (`None` for a stream)."""

    plan: StepPlan
    rule: LRRule
    starting_effective_batch_size: int
    nominal_steps: int
    steps_per_epoch: int | None = None
    gain_power: float | None = None
    noise_scale_at: Callable[[int], float] | None = None

    def virtual_step(self, step: int) -> float:
        """Position of `step` on the base schedule: the plain Trainer's steps of B0 per epoch, then the samples into
        the epoch over B0; exactly `step` at a constant batch."""
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
        return lr_scale(self.rule, samples, self.starting_effective_batch_size)

    def check(self) -> None:
        for samples in sorted(set(self.plan.sizes[self.plan.done_steps :])):
            self.multiplier(samples)

    def counts_steps(self) -> bool:
        """Whether the clock is the step count, unscaled: every step at its own place on a schedule built for the
        plan's steps, at x1 (a constant batch; an epoch's short last step counts as one)."""
        plan = self.plan
        steps = range(plan.done_steps, plan.num_steps)
        return self.nominal_steps == plan.num_steps and all(
            self.virtual_step(k) == k and self.scale(k) == 1 for k in steps
        )
