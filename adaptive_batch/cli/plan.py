"""`adaptive-batch plan`: what a run will do before it starts, planned by the Trainer path's own
[`~core.planning.plan_run`]: optimizer steps, samples, tokens, epochs and the learning-rate multiplier of every
phase, with warnings for the classic traps."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..core import report
from ..core.planning import RunPlan, RunSettings, plan_run
from ..core.schedule import PhaseSchedule, as_schedule, describe
from .arguments import positive_int, setting_help
from .dataset_facts import dataset_facts
from .training_args import apply_training_args

HELP = "print the steps, samples, tokens and LR of a run before it starts"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    data = parser.add_mutually_exclusive_group(required=True)
    data.add_argument("--dataset-size", type=positive_int, help="training samples")
    data.add_argument("--dataset", type=Path, help="a .jsonl/.json file or a datasets.save_to_disk folder")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="a tokenizer folder (save_pretrained): count the tokens of --dataset rows that hold 'text' or "
        "'messages' (chat template) rather than 'input_ids'",
    )
    parser.add_argument(
        "--args",
        type=Path,
        help="the run's saved TrainingArguments: a JSON of them (args.to_json_string()) or the training_args.bin "
        "the Trainer writes in each checkpoint (unpickled: only your own files); the flags below override it",
    )
    parser.add_argument(
        "script_args",
        nargs="*",
        metavar="-- SCRIPT ARGS",
        help="after --, your script's own command-line arguments (HfArgumentParser style, e.g. "
        "--per_device_train_batch_size 4 --num_train_epochs 2); the TrainingArguments fields among them override "
        "--args, the rest are ignored",
    )
    parser.add_argument(
        "--per-device", type=positive_int, help="per_device_train_batch_size (default: --args, else 8)"
    )
    parser.add_argument(
        "--accumulation", type=positive_int, help="gradient_accumulation_steps (default: --args, else 1)"
    )
    parser.add_argument("--gpus", type=positive_int, default=1, help="data-parallel processes (world size)")
    parser.add_argument(
        "--epochs", type=float, help="num_train_epochs (default: --args, else the Trainer's 3)"
    )
    parser.add_argument(
        "--max-steps",
        type=int,
        help="max_steps (overrides --epochs, as in the Trainer; default: --args, else -1: not set)",
    )
    parser.add_argument(
        "--schedule",
        help=setting_help(
            "schedule",
            "Here: the effective batch of each phase, e.g. 8,16,32 with --boundaries (default: per-device x "
            "accumulation x gpus).",
        ),
    )
    parser.add_argument(
        "--boundaries", default="", help="where phases 2.. start, e.g. 0.1,0.3 (default: none, one phase)"
    )
    parser.add_argument(
        "--unit",
        choices=("fraction", "samples", "steps"),
        default="fraction",
        help="what --boundaries count: a fraction of the budget, samples or optimizer steps",
    )
    parser.add_argument(
        "--lr-scaling", choices=("none", "sqrt", "linear"), default="none", help=setting_help("lr_scaling")
    )
    parser.add_argument(
        "--drop-last", action="store_true", help="dataloader_drop_last (default: --args, else off)"
    )


def run(options: argparse.Namespace) -> dict:
    """Plan the run as the Trainer will and return the plan as plain data ([`show`] prints it)."""
    apply_training_args(options)
    if options.dataset is None:
        dataset_size, tokens_per_epoch = options.dataset_size, None
    else:
        dataset_size, tokens_per_epoch = dataset_facts(options.dataset, options.tokenizer)
    schedule = _schedule(options)
    epochs = options.epochs if options.epochs is not None else RunSettings.num_train_epochs  # the Trainer's 3
    settings = RunSettings(
        dataset_size,
        epochs,
        options.max_steps,
        options.gpus,
        options.drop_last,
        per_device_train_batch_size=options.per_device,
        gradient_accumulation_steps=options.accumulation,
    )
    planned = plan_run(schedule, settings, options.lr_scaling)
    budget, plan, clock = planned.budget, planned.plan, planned.clock
    tokens = round(tokens_per_epoch * budget.samples / dataset_size) if tokens_per_epoch is not None else None
    return {
        "dataset_size": planned.dataset_size,
        "world_size": plan.world_size,
        "starting_effective_batch_size": planned.starting_effective_batch_size,
        "budget_samples": budget.samples,
        "budget_origin": budget.origin,
        "optimizer_steps": plan.num_steps,
        "samples": plan.num_samples,
        "tokens": tokens,
        "epochs": budget.samples / planned.dataset_size,
        "lr_schedule_steps": clock.nominal_steps,
        "phases": [
            {
                "first_step": first,
                "last_step": last,
                "effective_batch_size": effective,
                "per_device_samples": effective // plan.world_size,
                "lr_multiplier": clock.multiplier(effective),
            }
            for first, last, effective in plan.phases()
        ],
        "uneven_steps": [  # an epoch's short last step, or one holding a remainder too small for every rank
            {"step": step, "samples": samples, "scheduled": scheduled, "lr_multiplier": clock.scale(step)}
            for step, samples, scheduled in plan.uneven_steps()
        ],
        "notes": list(plan.notes),
        "warnings": _max_steps_traps(planned, options.epochs),
        "table": report.plan_rows(
            plan,
            clock,
            budget,
            schedule_text=describe(schedule),
            micro_batch_text="auto (decided while training)",
            tokens=tokens,
            rule_text=options.lr_scaling,
        ),
    }


def show(result: dict) -> None:
    """The plan as a table on stdout (rich where installed), its warnings on stderr."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(report.format_rows("AdaptiveBatch plan", result["table"]))
    else:
        table = Table(title="AdaptiveBatch plan", show_header=False, title_justify="left")
        for label, value in result["table"]:
            table.add_row(label, value)
        Console().print(table)
    for warning in result["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)


def _max_steps_traps(planned: RunPlan, epochs: float | None) -> list[str]:
    """Where `max_steps` does not mean what the user may think: it overrides the epochs, and AdaptiveBatch counts
    it in samples of the starting batch, not in steps of the growing ones."""
    max_steps = planned.settings.max_steps
    if max_steps <= 0:
        return []
    warnings = []
    if epochs is not None:
        warnings.append(
            f"max_steps={max_steps} and num_train_epochs={epochs:g} are both set: max_steps wins "
            "and num_train_epochs is ignored, as in the Trainer."
        )
    plan, starting = planned.plan, planned.starting_effective_batch_size
    if len(plan.phases()) > 1:
        # the plain Trainer's samples in max_steps steps of the scheduled batches
        plain_samples = sum(plan.scheduled[min(k, plan.num_steps - 1)] for k in range(max_steps))
        warnings.append(
            f"max_steps={max_steps} with a growing batch: AdaptiveBatch counts it as {planned.budget.samples:,} "
            f"samples ({max_steps} steps of {starting}) and runs {plan.num_steps:,} optimizer steps; the plain "
            f"Trainer would run {max_steps} steps of the larger batches, {plain_samples:,} samples."
        )
    return warnings


def _schedule(options: argparse.Namespace):
    """The schedule of --schedule and --boundaries; without them, per-device x accumulation x gpus throughout."""
    if options.schedule is None:
        if options.boundaries:
            raise ValueError(
                "--boundaries needs --schedule with one more size than boundaries, e.g. --schedule 8,16"
            )
        return as_schedule(options.per_device * options.accumulation * options.gpus)
    sizes = [_int_item(item, "--schedule") for item in options.schedule.split(",")]
    boundaries = [
        _number_item(item, "--boundaries") for item in options.boundaries.split(",") if item.strip()
    ]
    return PhaseSchedule(sizes, boundaries, unit=options.unit)


def _int_item(text: str, flag: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{flag} item {text!r} is not an integer; use e.g. {flag} 8,16,32.") from None


def _number_item(text: str, flag: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{flag} item {text!r} is not a number; use e.g. {flag} 0.1,0.3.") from None
    return int(value) if value.is_integer() and value >= 1 else value
