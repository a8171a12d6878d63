"""The plan table logged when training starts (and printed by `adaptive-batch plan`). Pure Python.

Steps are numbered from 1 in the table, as the Trainer logs them (`state.global_step` after the step); the plan
itself indexes them from 0."""

from __future__ import annotations

from .lr import SampleClock
from .steps import Budget, StepPlan


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
    layout_text: str | None = None,
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
        *([("layout", layout_text)] if layout_text is not None else []),
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
        rows.append(
            ("phases (steps: effective batch)", ", ".join(f"{a + 1}-{b + 1}: {e}" for a, b, e in phases))
        )
    uneven = plan.uneven_steps()
    if uneven:
        rows.append(("uneven steps", _uneven_text(uneven, clock, plan)))
    if plan.done_steps:
        done = plan.done_steps
        rows.append(
            (
                "already trained",
                f"steps 1-{done} ({plan.samples_before_step[done]:,} samples), by the plain Trainer before the "
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
        parts.append(f"step {step + 1}: {samples} of {scheduled} ({why}; LR x{clock.scale(step):.3g})")
    if len(uneven) > shown:
        parts.append(f"{len(uneven) - shown} more")
    return "; ".join(parts)


def format_rows(title: str, rows: list[tuple[str, str]]) -> str:
    width = max(len(label) for label, _ in rows)
    lines = [title] + [f"  {label:<{width}}  {value}" for label, value in rows]
    return "\n".join(lines)


def _per_rank(effective: int, world: int) -> str:
    return str(effective // world)
