"""`adaptive-batch plan`: a run's optimizer steps, samples, tokens, epochs and each phase's LR multiplier before it
starts, by the Trainer path's own [`~core.planning.plan_run`], with warnings for the classic traps."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..core import report
from ..core.controllers import choose_layout
from ..core.planning import RunSettings, plan_run
from ..core.schedule import PhaseSchedule, as_schedule, describe
from ..core.traps import explicit_epochs, run_traps
from .arguments import integer, positive_int, positive_number, setting_help
from .dataset_facts import DatasetFacts, dataset_facts
from .sft_args import read_sft_args
from .training_args import apply_training_args

HELP = "print the steps, samples, tokens and LR of a run before it starts"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    data = parser.add_mutually_exclusive_group(required=True)
    data.add_argument("--dataset-size", type=positive_int(1000, "--dataset-size"), help="training samples")
    data.add_argument("--dataset", type=Path, help="a .jsonl/.json file or a datasets.save_to_disk folder")
    add(
        "--tokenizer",
        type=Path,
        help="a tokenizer folder (save_pretrained): prepare --dataset rows that hold 'text', 'messages' or "
        "'prompt'/'completion' as TRL's SFTTrainer does (chat template, EOS, truncation at max_length, packing, with "
        "the SFTConfig fields of --args and the script arguments) and count its rows and tokens",
    )
    add(
        "--args",
        type=Path,
        help="the run's saved TrainingArguments or SFTConfig: a JSON of them (args.to_json_string()) or the "
        "training_args.bin the Trainer writes in each checkpoint (unpickled: only your own files); the flags below "
        "override it",
    )
    add(
        "script_args",
        nargs="*",
        metavar="-- SCRIPT ARGS",
        help="after --, your script's own command-line arguments (HfArgumentParser style, e.g. "
        "--per_device_train_batch_size 4 --num_train_epochs 2 --max_length 1024 --packing); the TrainingArguments "
        "and SFTConfig fields among them override --args; options that are neither are named, not read",
    )
    add("--per-device", type=positive_int(8), help="per_device_train_batch_size (default: --args, else 8)")
    add("--accumulation", type=positive_int(4), help="gradient_accumulation_steps (default: --args, else 1)")
    add("--gpus", type=positive_int(2), default=1, help="data-parallel processes (world size)")
    add(
        "--epochs", type=positive_number("3"), help="num_train_epochs (default: --args, else the Trainer's 3)"
    )
    add(
        "--max-steps",
        type=integer("500"),
        help="max_steps (overrides --epochs, as in the Trainer; default: --args, else -1: not set)",
    )
    add(
        "--schedule",
        help=setting_help(
            "schedule",
            "the size of each phase, comma-separated, e.g. 8,16,32 with --boundaries 0.1,0.3 (one size: a constant "
            "batch; default: per-device x accumulation x gpus; growth by the noise scale is decided while training, "
            "so it is not planned here)",
        ),
    )
    add("--boundaries", default="", help="where phases 2.. start, e.g. 0.1,0.3 (default: none, one phase)")
    add(
        "--unit",
        choices=("fraction", "samples", "steps"),
        default="fraction",
        help="what --boundaries count: a fraction of the budget, samples or optimizer steps",
    )
    add(
        "--lr-scaling",
        choices=("none", "sqrt", "linear"),
        default="none",
        help=setting_help(
            "lr_scaling",
            "none (unchanged), sqrt (Adam family: x sqrt(B / B0), B the effective batch, B0 the starting one) or "
            "linear (SGD: x B / B0)",
        ),
    )
    add("--drop-last", action="store_true", help="dataloader_drop_last (default: --args, else off)")
    add(
        "--attention",
        default="sdpa",
        help="the model's attn_implementation (from_pretrained's argument; transformers' default is sdpa): the "
        "layout row says how AdaptiveBatch() runs a padding collator's steps under it and what flex attention "
        "would give",
    )


def run(options: argparse.Namespace) -> dict:
    """Plan the run as the Trainer will and return the plan as plain data ([`show`] prints it)."""
    apply_training_args(options)
    sft = read_sft_args(options)
    if options.dataset is not None:
        facts = dataset_facts(options.dataset, options.tokenizer, sft)
    else:
        facts = DatasetFacts(options.dataset_size, None)
        # the SFT fields that change the rows or tokens, which plan counts only from a --dataset file
        if given := sft.changed(leave_out=("seed", "dataset_num_proc")):
            facts.not_used.append(
                f"{given}: they change the rows or tokens SFTTrainer trains on, which plan counts only from "
                "--dataset (with --tokenizer); --dataset-size is taken as the rows trained on"
            )
    if unknown := sft.unknown_options:
        facts.not_used.insert(
            0,
            f"{', '.join(unknown)} after --: no field of SFTConfig or TrainingArguments, so plan does not read "
            f"{'it' if len(unknown) == 1 else 'them'} (a dataset named there is not --dataset)",
        )
    schedule = _schedule(options)
    epochs = options.epochs if options.epochs is not None else RunSettings.num_train_epochs  # the Trainer's 3
    # num_train_epochs where the user set it: a saved TrainingArguments holds 3 whether or not it was set
    source = options.given.get("epochs")
    epochs_given = explicit_epochs(options.epochs) if source == "args" else options.epochs if source else None
    settings = RunSettings(
        facts.rows,
        epochs,
        options.max_steps,
        options.gpus,
        options.drop_last,
        per_device_train_batch_size=options.per_device,
        gradient_accumulation_steps=options.accumulation,
    )
    planned = plan_run(schedule, settings, options.lr_scaling)
    # the rows' lengths are not read here (None: as an attach before the first step sees them)
    packs = any(sft.given.get(name) is True for name in ("packing", "padding_free"))
    # a causal LM, its library loss; no model here to check (`None`: the row says where a check decides)
    layout = choose_layout(None, packs, options.attention, None, causal=True, shown=lambda layout: None)
    budget, plan, clock = planned.budget, planned.plan, planned.clock
    tokens = round(facts.tokens * budget.samples / facts.rows) if facts.tokens is not None else None
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
        "layout": {"padding_free": layout.flatten, "text": layout.text},
        "notes": list(plan.notes),
        "dataset_notes": facts.notes,  # how the rows and tokens were counted, where not as the file holds them
        "not_used": facts.not_used,  # one line for each setting given that the plan could not follow
        "warnings": run_traps(
            planned,
            schedule,
            epochs_given=epochs_given,
            # the batch settings defaulted (not given) cannot disagree with the schedule
            schedule_given=options.schedule is not None
            and bool({"per_device", "accumulation"} & set(options.given)),
        ),
        "table": report.plan_rows(
            planned,
            schedule_text=describe(schedule),
            micro_batch_text="auto (decided while training)",
            tokens=tokens,
            rule_text=options.lr_scaling,
            layout_text=layout.text,
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
    for prefix, key in (("note", "dataset_notes"), ("not used", "not_used"), ("warning", "warnings")):
        for line in result[key]:
            print(f"{prefix}: {line}", file=sys.stderr)


def _schedule(options: argparse.Namespace):
    """The schedule of --schedule and --boundaries; without them, per-device x accumulation x gpus throughout."""
    if options.schedule is None:
        if options.boundaries:
            raise ValueError(
                "--boundaries needs --schedule with one more size than boundaries, e.g. --schedule 8,16"
            )
        return as_schedule(options.per_device * options.accumulation * options.gpus)
    sizes = [_int_item(item, "--schedule") for item in options.schedule.split(",")]
    boundaries = [_boundary(item, options.unit) for item in options.boundaries.split(",") if item.strip()]
    return PhaseSchedule(sizes, boundaries, unit=options.unit)


def _int_item(text: str, flag: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{flag} item {text!r} is not an integer; use e.g. {flag} 8,16,32.") from None


def _boundary(text: str, unit: str) -> float:
    """One --boundaries item: a fraction in (0, 1) with --unit fraction, else a positive int (steps or samples)."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if unit == "fraction":
        if value is None:
            raise ValueError(f"--boundaries item {text!r} is not a number; use e.g. --boundaries 0.1,0.3.")
        return int(value) if value.is_integer() else value  # (a whole number is refused as [2], not [2.0])
    if value is None or value <= 0 or not value.is_integer():
        counted = "optimizer steps taken" if unit == "steps" else "samples seen"
        example = "100,300" if unit == "steps" else "2000,6000"
        raise ValueError(
            f"--boundaries item {text.strip()!r} is not a positive int, as --unit {unit} needs ({counted}); use "
            f"e.g. --boundaries {example}, or --unit fraction for shares of the budget (e.g. --boundaries 0.1,0.3)."
        )
    return int(value)
