"""The plan table logged when training starts and printed by `adaptive-batch plan`. Steps are numbered from 1 in the
table, as the Trainer logs them; the plan indexes them from 0. Pure Python."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from .lr import SampleClock
from .plain_trainer import PlainBatching
from .planning import RunPlan
from .steps import StepPlan


@dataclass(frozen=True)
class StepStrategy:
    """Evaluation or saving by steps as the Trainer runs it: every multiple of `every` steps from `delay` on (a float
    `every` below 1 is that share of the run's steps, rounded up), and at the last step."""

    what: str
    field: str
    strategy: str
    every: float
    delay: float = 0.0

    def interval(self, total_steps: int) -> int:
        """Steps between two events in a run of `total_steps` (transformers' `TrainerState.compute_steps`)."""
        return max(1, math.ceil(total_steps * self.every)) if self.every < 1 else int(self.every)

    def steps(self, total_steps: int) -> list[int]:
        """The steps (numbered from 1, as the Trainer logs them) that evaluate or save in a run of `total_steps`."""
        interval = self.interval(total_steps)
        steps = list(range(interval, total_steps + 1, interval))
        if total_steps % interval:
            steps.append(total_steps)  # the run's last step evaluates and saves too
        return [step for step in steps if step >= self.delay]


def step_strategy_rows(
    plan: StepPlan,
    plain: PlainBatching,
    plain_steps: int,
    strategies: list[StepStrategy],
    may_grow_to: int | None = None,
) -> list[tuple[str, str]]:
    """Where evaluation and saving by steps happen under a changing batch, against the plain Trainer's equal intervals
    of samples, and how to keep those; none at a constant batch. `may_grow_to`: a `NoiseScaleSchedule`'s `max_size`."""
    phases = plan.phases()
    if len(phases) < 2 and may_grow_to is None:
        return []
    plain_samples = [0, *itertools.accumulate(plain.step_sizes(plain_steps))]
    largest = max([effective for _, _, effective in phases] + [may_grow_to or 0])
    rows = []
    for strategy in strategies:
        gap = strategy.interval(plain_steps) * plain.effective_batch_size
        setting = f"{strategy.field}={strategy.every:g}"
        if len(phases) > 1:
            ours, theirs = strategy.steps(plan.num_steps), strategy.steps(plain_steps)
            text = (
                f"{setting} counts steps of the batch of the time: steps {_steps_text(ours, plan.samples_before_step)}"
                f"; the plain Trainer's: {_steps_text(theirs, plain_samples)}"
            )
        else:
            text = (
                f"{setting} counts steps of the batch of the time: the plain Trainer's steps (every {gap:,} samples) "
                f"until the batch grows (decided while training, up to {may_grow_to}), more samples apart after"
            )
        verb = "evaluate" if strategy.what == "evaluation" else "save"
        keep = max(1, gap // largest)
        if keep * largest == gap and len(phases) > 1 and keep == strategy.interval(plan.num_steps):
            text += (
                f"; it still {verb}s at least every {gap:,} samples, the plain Trainer's interval (more often at the "
                "smaller batches)"
            )
        else:
            apart = (
                f"{keep * largest:,} samples apart at the largest batch, {largest}, more often at smaller ones"
                if keep * largest <= gap
                else f"the closest: one step of the largest batch, {largest}, holds more"
            )
            text += (
                f". To {verb} at least every {gap:,} samples, as the plain Trainer does: {strategy.field}={keep} "
                f"({apart}), or {strategy.strategy}='epoch', which follows data epochs (a float {strategy.field} is a "
                "share of the steps, not of the samples)"
            )
        rows.append((f"{strategy.what} by steps", text))
    return rows


def _steps_text(steps: list[int], samples_before_step, shown: int = 6) -> str:
    """'8, 16, 17 (after 128, 384, 400 samples)'; past `shown` steps the first ones, '...' and the last."""
    elided = len(steps) > shown
    if elided:
        steps = [*steps[: shown - 1], steps[-1]]

    def listed(values) -> str:
        text = [f"{value:,}" for value in values]
        if elided:
            text[-1] = f"... {text[-1]}"
        return ", ".join(text)

    return f"{listed(steps)} (after {listed([samples_before_step[step] for step in steps])} samples)"


def plan_rows(
    run: RunPlan,
    schedule_text: str,
    micro_batch_text: str,
    rule_text: str,
    layout_text: str,
    tokens: int | None = None,
    plain_steps: int | None = None,
    accumulation_text: str = "samples per rank per step / micro-batch, decided while training",
) -> list[tuple[str, str]]:
    plan, clock = run.plan, run.clock
    phases, world = plan.phases(), plan.world_size
    per_rank = " -> ".join(str(effective // world) for _, _, effective in phases)
    scales = " -> ".join(f"x{clock.multiplier(effective):.3g}" for _, _, effective in phases)
    steps = f"{plan.num_steps:,}"
    if plain_steps is not None and plain_steps != plan.num_steps:
        steps += f" (the plain Trainer: {plain_steps:,})"
    rows = [
        ("effective batch", schedule_text),
        ("micro-batch", micro_batch_text),
        ("layout", layout_text),
        ("samples per rank per step", per_rank),
        ("accumulation", accumulation_text),
        ("world size", str(world)),
        ("optimizer steps", steps),
        ("samples", f"{plan.num_samples:,} from {run.budget.origin}"),
        ("tokens", f"{tokens:,} (non-padding)" if tokens is not None else "not known before training"),
        ("epochs", f"{plan.budget / plan.dataset_size:g} of {plan.dataset_size:,} samples"),
        (
            "learning rate",
            f"{rule_text}: {scales}; schedule built for {clock.nominal_steps:,} steps of "
            f"{clock.starting_effective_batch_size} and followed by samples",
        ),
    ]
    if len(phases) > 1:
        text = ", ".join(f"{a + 1}-{b + 1}: {e}" for a, b, e in phases)
        rows.append(("phases (steps: effective batch)", text))
    if uneven := plan.uneven_steps():
        rows.append(("uneven steps", _uneven_text(uneven, clock, plan)))
    if done := plan.done_steps:
        samples = plan.samples_before_step[done]
        text = f"steps 1-{done} ({samples:,} samples), by the plain Trainer before the checkpoint"
        rows.append(("already trained", text))
    rows.extend(("note", note) for note in plan.notes)
    return rows


def _uneven_text(uneven: list[tuple[int, int, int]], clock: SampleClock, plan, shown: int = 4) -> str:
    """Steps holding other than their scheduled batch, each with the LR multiplier for what it holds."""
    parts = []
    for step, samples, scheduled in uneven[:shown]:
        if samples > scheduled:
            why = "with a remainder too small for every rank"
        elif step == plan.num_steps - 1 and plan.budget % plan.dataset_size:
            why = "the budget's rest"  # the budget ends inside an epoch
        else:
            why = "an epoch's rest"
        parts.append(f"step {step + 1}: {samples} of {scheduled} ({why}; LR x{clock.scale(step):.3g})")
    if len(uneven) > shown:
        parts.append(f"{len(uneven) - shown} more")
    return "; ".join(parts)


def format_rows(title: str, rows: list[tuple[str, str]]) -> str:
    width = max(len(label) for label, _ in rows)
    return "\n".join([title] + [f"  {label:<{width}}  {value}" for label, value in rows])
