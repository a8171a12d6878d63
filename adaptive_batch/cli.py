"""`adaptive-batch`: the command line.

    adaptive-batch plan --dataset-size 52000 --per-device 4 --accumulation 8 --gpus 2 --epochs 3 \\
        --schedule 32,64,128 --boundaries 0.1,0.3 --lr-scaling sqrt

`plan` prints what a run will do before it starts: optimizer steps, samples, tokens, epochs and the learning-rate
multiplier of every phase, with warnings for the classic traps. `--json` prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import __version__, report
from .lr import SampleClock, lr_scale, nominal_steps, resolve_rule
from .plan import Budget, build_plan
from .schedule import PhaseSchedule, Progress, as_schedule, describe


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adaptive-batch", description="Exact, adaptive batch sizes for the HF Trainer."
    )
    parser.add_argument("--version", action="version", version=f"adaptive-batch {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    plan = commands.add_parser(
        "plan", help="print the steps, samples, tokens and LR of a run before it starts"
    )
    data = plan.add_mutually_exclusive_group(required=True)
    data.add_argument("--dataset-size", type=_positive_int, help="training samples")
    data.add_argument("--dataset", type=Path, help="a .jsonl/.json file or a datasets.save_to_disk folder")
    plan.add_argument("--per-device", type=_positive_int, default=8, help="per_device_train_batch_size")
    plan.add_argument("--accumulation", type=_positive_int, default=1, help="gradient_accumulation_steps")
    plan.add_argument("--gpus", type=_positive_int, default=1, help="data-parallel processes (world size)")
    plan.add_argument(
        "--epochs", type=float, default=None, help="num_train_epochs (the Trainer's default: 3)"
    )
    plan.add_argument(
        "--max-steps", type=int, default=-1, help="max_steps (overrides --epochs, as in the Trainer)"
    )
    plan.add_argument("--schedule", help="effective batch per phase, e.g. 8,16,32 (default: the user's)")
    plan.add_argument("--boundaries", default="", help="where phases 2.. start, e.g. 0.1,0.3")
    plan.add_argument("--unit", choices=("fraction", "samples", "steps"), default="fraction")
    plan.add_argument("--lr-scaling", choices=("none", "sqrt", "linear"), default="none")
    plan.add_argument("--drop-last", action="store_true", help="dataloader_drop_last")
    plan.add_argument("--json", action="store_true", help="one JSON object on stdout")
    return parser


def plan_command(options: argparse.Namespace) -> dict:
    """Build the plan the Trainer would run and return it as plain data (printed by `main`)."""
    size, tokens_per_epoch = _dataset_facts(options)
    default_effective = options.per_device * options.accumulation * options.gpus
    schedule = _schedule(options, default_effective)
    starting = schedule(Progress(0, 0, 0.0))
    warnings = []
    if options.max_steps > 0:
        budget = Budget.from_max_steps(options.max_steps, starting)
        if options.epochs is not None:
            warnings.append(
                f"max_steps={options.max_steps} and num_train_epochs={options.epochs:g} are both set: max_steps wins "
                "and num_train_epochs is ignored, as in the Trainer."
            )
    else:
        budget = Budget.from_epochs(options.epochs if options.epochs is not None else 3.0, size)
    plan = build_plan(schedule, size, budget, options.gpus, options.drop_last)
    rule = resolve_rule(options.lr_scaling)
    clock = SampleClock(plan, rule, starting, nominal_steps(budget.samples, starting))
    phases = plan.phases()
    if options.max_steps > 0 and len(phases) > 1:
        warnings.append(
            f"max_steps={options.max_steps} with a growing batch: AdaptiveBatch counts it as {budget.samples:,} "
            f"samples ({options.max_steps} steps of {starting}) and runs {plan.num_steps:,} optimizer steps; the plain "
            f"Trainer would run {options.max_steps} steps of the larger batches, "
            f"{_plain_max_steps_samples(plan, options.max_steps):,} samples."
        )
    tokens = round(tokens_per_epoch * budget.samples / size) if tokens_per_epoch is not None else None
    return {
        "dataset_size": size,
        "world_size": options.gpus,
        "starting_effective_batch_size": starting,
        "budget_samples": budget.samples,
        "budget_origin": budget.origin,
        "optimizer_steps": plan.num_steps,
        "samples": plan.num_samples,
        "tokens": tokens,
        "epochs": budget.samples / size,
        "lr_schedule_steps": clock.nominal_steps,
        "phases": [
            {
                "first_step": first,
                "last_step": last,
                "effective_batch_size": effective,
                "per_device_samples": effective // options.gpus,
                "lr_multiplier": lr_scale(rule, effective, starting),
            }
            for first, last, effective in phases
        ],
        "notes": list(plan.notes),
        "warnings": warnings,
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    options = parser.parse_args(argv)
    try:
        result = plan_command(options)
    except (ValueError, OSError) as error:
        print(f"adaptive-batch: error: {error}", file=sys.stderr)
        return 1
    if options.json:
        result = {key: value for key, value in result.items() if key != "table"}
        print(json.dumps(result, indent=1))
    else:
        _print_plan(result)
    return 0


def _print_plan(result: dict) -> None:
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


def _schedule(options, default_effective: int):
    if options.schedule is None:
        if options.boundaries:
            raise ValueError(
                "--boundaries needs --schedule with one more size than boundaries, e.g. --schedule 8,16"
            )
        return as_schedule(default_effective)
    sizes = [_int_item(item, "--schedule") for item in options.schedule.split(",")]
    boundaries = [
        _number_item(item, "--boundaries") for item in options.boundaries.split(",") if item.strip()
    ]
    return PhaseSchedule(sizes, boundaries, unit=options.unit)


def _dataset_facts(options) -> tuple[int, int | None]:
    """(rows, tokens per epoch or None) from --dataset-size or --dataset."""
    if options.dataset is None:
        return options.dataset_size, None
    path = options.dataset
    if not path.exists():
        raise ValueError(
            f"--dataset {path} does not exist; pass a .jsonl/.json file or a save_to_disk folder."
        )
    if path.is_dir():
        from datasets import load_from_disk

        dataset = load_from_disk(str(path))
        if hasattr(dataset, "keys"):
            if "train" not in dataset:
                raise ValueError(
                    f"--dataset {path} is a DatasetDict without a 'train' split: {sorted(dataset)}."
                )
            dataset = dataset["train"]
        tokens = None
        if "input_ids" in dataset.column_names:
            import pyarrow.compute as pc

            tokens = pc.sum(pc.list_value_length(dataset.data.column("input_ids"))).as_py()
        return len(dataset), tokens
    records = _read_records(path)
    if not records:
        raise ValueError(f"--dataset {path} holds no records.")
    with_ids = [
        r["input_ids"] for r in records if isinstance(r, dict) and isinstance(r.get("input_ids"), list)
    ]
    return len(records), sum(map(len, with_ids)) if len(with_ids) == len(records) else None


def _read_records(path: Path) -> list:
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
        return data if isinstance(data, list) else data.get("data", [])
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _plain_max_steps_samples(plan, max_steps: int) -> int:
    """Samples the plain Trainer would consume in `max_steps` steps of the scheduled batches."""
    return sum(plan.scheduled[min(k, plan.num_steps - 1)] for k in range(max_steps))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


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


if __name__ == "__main__":
    raise SystemExit(main())
