"""The plan table logged when training starts (and printed by `adaptive-batch plan`). Pure Python."""

from __future__ import annotations

import math

from .lr import SampleClock
from .plan import Budget, StepPlan


def plan_rows(
    plan: StepPlan,
    clock: SampleClock,
    budget: Budget,
    schedule_text: str,
    micro_batch_text: str,
    plain_steps: int | None = None,
    tokens: int | None = None,
    rule_text: str = "none",
    accumulation_text: str = "samples per rank per step / micro-batch, decided while training",
) -> list[tuple[str, str]]:
    """(label, value) rows describing a plan, in reading order."""
    phases = plan.phases()
    world = plan.world_size
    per_rank = " -> ".join(_per_rank(effective, world) for _, _, effective in phases)
    scales = " -> ".join(f"x{clock.multiplier(effective):.3g}" for _, _, effective in phases)
    steps = f"{plan.num_steps:,}"
    if plain_steps is not None and plain_steps != plan.num_steps:
        steps += f" (the plain Trainer: {plain_steps:,})"
    rows = [
        ("effective batch", schedule_text),
        ("micro-batch", micro_batch_text),
        ("samples per rank per step", per_rank),
        ("accumulation", accumulation_text),
        ("world size", str(world)),
        ("optimizer steps", steps),
        ("samples", f"{plan.num_samples:,} from {budget.origin}"),
        ("tokens", f"{tokens:,} (non-padding)" if tokens is not None else "not known before training"),
        ("epochs", f"{plan.budget / plan.dataset_size:g} of {plan.dataset_size:,} samples"),
        (
            "learning rate",
            f"{rule_text}: {scales}; schedule built for {clock.nominal_steps:,} steps of "
            f"{clock.starting_effective_batch_size} and followed by samples",
        ),
    ]
    if len(phases) > 1:
        rows.append(("phases (steps: effective batch)", ", ".join(f"{a}-{b}: {e}" for a, b, e in phases)))
    uneven = plan.uneven_steps()
    if uneven:
        rows.append(("uneven steps", _uneven_text(uneven, clock, plan)))
    if plan.done_steps:
        done = plan.done_steps
        rows.append(
            (
                "already trained",
                f"steps 0-{done - 1} ({plan.samples_before_step[done]:,} samples), by the plain Trainer before the "
                "checkpoint",
            )
        )
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
        parts.append(f"step {step}: {samples} of {scheduled} ({why}; LR x{clock.scale(step):.3g})")
    if len(uneven) > shown:
        parts.append(f"{len(uneven) - shown} more")
    return "; ".join(parts)


def micro_batch_text(
    size: int,
    auto: bool,
    exploring: bool,
    growth_margin: float,
    max_micro_batch_size: int | None,
    max_tokens: int | None,
    max_rows_per_rank: int,
    tuning_tokens: bool = False,
) -> str:
    """How each step is cut into micro-batches, for the plan table."""
    if max_tokens is not None:
        text = f"cut by a token budget of {max_tokens:,} padded tokens (rows x padded length)"
        if tuning_tokens:
            text = (
                f"auto, rows of varying length: cut by padded tokens (rows x padded length), at the least time; "
                f"the budget starts at {max_tokens:,} and doubles while the cut needs more and memory allows"
            )
        if size < max_rows_per_rank:
            text += f", at most {size} rows"
        return text + "; the budget halves and the step retries on out-of-memory"
    if auto and exploring:
        text = f"auto: starts at {size}, doubles while tokens/s gain > {growth_margin:.0%}"
    else:
        text = f"{size}" + ("" if auto else " (fixed)")
    if max_micro_batch_size:
        text += f", at most {max_micro_batch_size}"
    return text + "; shrinks and retries the step on out-of-memory"


def accumulation_text(plan: StepPlan, user_accumulation: int, fixed_size: int | None, by_tokens: bool) -> str:
    """Micro-batches per step: known before training for a fixed size, decided while training otherwise."""
    if by_tokens:
        return f"as many as the rows' lengths need (the user's: {user_accumulation})"
    if fixed_size is None:
        return f"samples per rank per step / micro-batch (the user's: {user_accumulation})"
    counts = sorted(
        {math.ceil(effective // plan.world_size / fixed_size) for _, _, effective in plan.phases()}
    )
    return " -> ".join(map(str, counts)) + f" micro-batches of at most {fixed_size}"


def format_rows(title: str, rows: list[tuple[str, str]]) -> str:
    width = max(len(label) for label, _ in rows)
    lines = [title] + [f"  {label:<{width}}  {value}" for label, value in rows]
    return "\n".join(lines)


def _per_rank(effective: int, world: int) -> str:
    return str(effective // world)
