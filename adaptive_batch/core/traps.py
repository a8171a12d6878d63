"""The classic traps of a run's settings, as warnings that name the fix, printed by `adaptive-batch plan` and logged
by the Trainer alike (docs/how-it-works.md, "The commands"). Pure Python."""

from __future__ import annotations

import math

from .goodput import NoiseScaleSchedule
from .planning import RunPlan
from .schedule import PhaseSchedule, Progress, Schedule

TRAINER_DEFAULT_EPOCHS = 3.0  # TrainingArguments.num_train_epochs


def explicit_epochs(num_train_epochs: float | None) -> float | None:
    """`num_train_epochs` where given on purpose, as far as one can tell (the default 3 counts as not given)."""
    return None if num_train_epochs == TRAINER_DEFAULT_EPOCHS else num_train_epochs


def run_traps(
    run: RunPlan, schedule: Schedule, epochs_given: float | None = None, schedule_given: bool = False
) -> list[str]:
    """The warnings for `run` under `schedule`; `schedule_given`: it and the batch settings were both set."""
    return [
        *_max_steps_traps(run, schedule, epochs_given),
        *_phase_traps(run, schedule),
        *_mid_epoch_trap(run),
        *_above_dataset_traps(run, schedule),
        *_whole_epoch_trap(run),
        *_start_traps(run, schedule_given),
    ]


def probed_traps(micro_batch_size: int | str, per_device_eval_batch_size: int, probed) -> list[str]:
    """A start above what `adaptive-batch probe` found to fit (`probed`'s `boundary`, `eval_boundary`)."""
    seq_len, boundary, eval_boundary = probed.seq_len, probed.boundary, probed.eval_boundary
    warnings = []
    if isinstance(micro_batch_size, int) and boundary is not None and micro_batch_size > boundary:
        warnings.append(
            f"micro_batch_size={micro_batch_size} is above the largest micro-batch adaptive-batch probe found to "
            f"fit for this setup at {seq_len:,} tokens ({boundary}): the first step will run out of memory and run "
            f"again smaller. Set micro_batch_size={boundary}, or 'auto' to start from the probe's choice."
        )
    if eval_boundary is not None and per_device_eval_batch_size > eval_boundary:
        warnings.append(
            f"per_device_eval_batch_size={per_device_eval_batch_size} is above the largest eval batch "
            f"adaptive-batch probe found to fit for this setup at {seq_len:,} tokens ({eval_boundary}): the first "
            f"eval batch will run out of memory and run again in pieces. Set per_device_eval_batch_size="
            f"{eval_boundary}."
        )
    return warnings


def _max_steps_traps(run: RunPlan, schedule: Schedule, epochs_given: float | None) -> list[str]:
    max_steps = run.settings.max_steps
    if max_steps <= 0:
        return []
    warnings = []
    if epochs_given is not None:
        warnings.append(
            f"max_steps={max_steps} and num_train_epochs={epochs_given:g} are both set: max_steps wins and "
            "num_train_epochs is ignored, as in the Trainer. Set only one of them."
        )
    plan, starting, samples = run.plan, run.starting_effective_batch_size, run.budget.samples
    phases = plan.phases()
    if len(phases) > 1:
        plain_samples = sum(plan.scheduled[min(k, plan.num_steps - 1)] for k in range(max_steps))
        later = [effective for _, _, effective in phases[1:]]
        change = "growing" if min(later) > starting else "shrinking" if max(later) < starting else "changing"
        more, fix = ("more", "raise") if plain_samples > samples else ("fewer", "lower")
        sizes = " -> ".join(str(effective) for _, _, effective in phases)
        warnings.append(
            f"max_steps={max_steps} with a {change} batch ({sizes}): AdaptiveBatch counts it as {samples:,} samples "
            f"({max_steps} steps of {starting}) and runs {plan.num_steps:,} optimizer steps; the plain Trainer would "
            f"run {max_steps} steps of the scheduled batches, {plain_samples:,} samples. To train on {more} samples, {fix} max_steps (in steps of the starting batch) or give the budget in "
            "num_train_epochs."
        )
    elif isinstance(schedule, NoiseScaleSchedule):
        warnings.append(
            f"max_steps={max_steps} with a batch that may grow (NoiseScaleSchedule): AdaptiveBatch counts it as "
            f"{samples:,} samples ({max_steps} steps of {starting}), so each growth shortens the run in steps, while "
            "the plain Trainer would run max_steps steps of the larger batches. To train on more samples, raise "
            "max_steps (in steps of the starting batch) or give the budget in num_train_epochs."
        )
    return warnings


def _phase_traps(run: RunPlan, schedule: Schedule) -> list[str]:
    if not isinstance(schedule, PhaseSchedule) or not schedule.boundaries:
        return []
    plan = run.plan
    last = plan.num_steps - 1
    reached = max(
        schedule.phase(Progress(step, plan.samples_before_step[step], plan.starts[step] / plan.budget))
        for step in range(plan.done_steps, plan.num_steps)
    )
    unreached = schedule.boundaries[reached:]
    if not unreached:
        return []
    samples, fraction = plan.samples_before_step[last], plan.starts[last] / plan.budget
    at = {
        "steps": (last, f"its last step is step {last:,} (steps counted from 0)"),
        "samples": (samples, f"its last step starts at {samples:,} samples seen"),
        "fraction": (fraction, f"its last step starts at fraction {fraction:.3f} of the budget"),
    }
    limit, where = at[schedule.unit]
    limit_text = f"{limit:.3f}" if schedule.unit == "fraction" else f"{limit:,}"
    fix = f"lower the boundaries to at most {limit_text} {schedule.unit}"
    if schedule.unit == "steps":
        fix += " (fewer still where the batch grows earlier: larger steps take the budget in fewer of them)"
    if schedule.unit != "fraction":
        fix += ", give them as fractions of the budget (unit 'fraction')"
    fix += ", or raise num_train_epochs / max_steps"
    if reached == 0:
        return [
            f"The schedule never leaves its first phase within the budget: its first boundary is at "
            f"{schedule.boundaries[0]:g} {schedule.unit} but {where}, so every step trains at "
            f"{schedule.sizes[0]} and {_listed('size', schedule.sizes[1:])} never used. To change "
            f"the batch, {fix}."
        ]
    return [
        f"The schedule {_listed('boundary', unreached, f' {schedule.unit}')} never reached within the budget: "
        f"{where}, so the effective {_listed('batch', schedule.sizes[reached + 1 :])} never used. To reach "
        f"{'them' if len(unreached) > 1 else 'it'}, {fix}."
    ]


def _mid_epoch_trap(run: RunPlan) -> list[str]:
    settings, dataset_size = run.settings, run.settings.dataset_size
    if settings.max_steps > 0 or dataset_size is None:
        return []
    rest = run.budget.samples % dataset_size
    if not rest:
        return []
    epochs = settings.num_train_epochs
    below, above = max(1, math.floor(epochs)), math.ceil(epochs)
    whole = f"num_train_epochs={below}" + (f" or {above}" if above != below else "")
    return [
        f"num_train_epochs={epochs:g} ends the run mid-epoch: the last epoch trains on {rest:,} of its "
        f"{dataset_size:,} {settings.unit}, so {1 - rest / dataset_size:.0%} of the data is seen once fewer than "
        f"the rest. Use a whole number of epochs ({whole}), or max_steps for a budget in steps."
    ]


def _above_dataset_traps(run: RunPlan, schedule: Schedule) -> list[str]:
    if not isinstance(schedule, PhaseSchedule) or run.settings.dataset_size is None:
        return []
    dataset_size, world = run.dataset_size, run.settings.world_size
    above = [size for size in schedule.sizes if size > dataset_size]
    if not above:
        return []
    return [
        f"The schedule's effective batch {', '.join(map(str, above))} is above the dataset's {dataset_size:,} "
        f"{run.settings.unit}: one optimizer step cannot hold more than one epoch, so the run is refused if it "
        f"reaches that phase (a larger budget, or a resume with more epochs). Give the schedule sizes of at most "
        f"{dataset_size // world * world}."
    ]


def _whole_epoch_trap(run: RunPlan) -> list[str]:
    settings, starting = run.settings, run.starting_effective_batch_size
    if settings.dataset_size is None or starting <= run.dataset_size:
        return []
    world = f"{settings.world_size} process{'es' if settings.world_size > 1 else ''}"
    return [
        f"per_device_train_batch_size={settings.per_device_train_batch_size} x gradient_accumulation_steps="
        f"{settings.gradient_accumulation_steps} x {world} = {starting} samples a step is more than the dataset's "
        f"{run.dataset_size:,} {settings.unit}: each optimizer step takes one whole epoch ({run.dataset_size:,}), "
        "as the plain Trainer's does. Make that product at most the dataset size for steps of the size you set."
    ]


def _start_traps(run: RunPlan, schedule_given: bool) -> list[str]:
    settings = run.settings
    per_device, accumulation = settings.per_device_train_batch_size, settings.gradient_accumulation_steps
    if not schedule_given or per_device is None:
        return []
    user, starting = settings.users_batch, run.starting_effective_batch_size
    if user == starting:
        return []
    world = f"{settings.world_size} process{'es' if settings.world_size > 1 else ''}"
    return [
        f"The schedule starts at {starting} samples a step but per_device_train_batch_size={per_device} x "
        f"gradient_accumulation_steps={accumulation} x {world} = {user}: the schedule wins, so the run starts at "
        f"{starting}, and max_steps and the LR schedule's length count steps of {starting}, not the plain "
        f"Trainer's steps of {user}. Make per_device_train_batch_size x gradient_accumulation_steps x world size "
        f"{starting}, or start the schedule at {user}."
    ]


def _listed(noun: str, values, unit: str = "") -> str:
    plural = {"boundary": "boundaries", "batch": "batches"}.get(noun, noun + "s")
    text = ", ".join(f"{value:g}" for value in values) + unit
    return f"{plural} {text} are" if len(values) > 1 else f"{noun} {text} is"
