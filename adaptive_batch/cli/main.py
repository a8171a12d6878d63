"""`adaptive-batch`: the command line.

    adaptive-batch probe ./llama --seq-len 1024 --load-in-4bit --lora-r 16 --lora-target q_proj,v_proj \\
        --optim paged_adamw_8bit --effective-batch 64
    adaptive-batch plan --dataset-size 52000 --per-device 4 --accumulation 8 --gpus 2 --epochs 3 \\
        --schedule 32,64,128 --boundaries 0.1,0.3 --lr-scaling sqrt
    adaptive-batch plot ./out

`probe` finds the largest micro-batch that fits and the fastest one, and caches the result for
`AdaptiveBatch(micro_batch_size="auto")`. `plan` prints what a run will do before it starts: optimizer steps,
samples, tokens, epochs and the learning-rate multiplier of every phase, with warnings for the classic traps. `plot`
draws a run's effective batch, micro-batch, noise scale, learning rate and loss against samples seen into a PNG,
from the log history the Trainer saved (needs matplotlib: `pip install "adaptive-batch[plot]"`).
`--json` prints one JSON object on stdout (logs go to stderr); a failure is one line on stderr and exit code 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path

from .. import __version__
from ..core import report
from ..core.lr import SampleClock, lr_scale, nominal_steps, resolve_rule
from ..core.plan import Budget, build_plan
from ..core.schedule import PhaseSchedule, Progress, as_schedule, describe
from ..runtime import lengths


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adaptive-batch", description="Exact, adaptive batch sizes for the HF Trainer."
    )
    parser.add_argument("--version", action="version", version=f"adaptive-batch {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    probe = commands.add_parser(
        "probe",
        help="find the largest micro-batch that fits, and the fastest one",
        formatter_class=_HelpFormatter,
    )
    probe.add_argument("model_dir", help="a folder written by save_pretrained")
    probe.add_argument("--seq-len", type=_positive_int, required=True, help="tokens per sample")
    probe.add_argument(
        "--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="weights / compute dtype"
    )
    probe.add_argument("--load-in-4bit", action="store_true", help="NF4 with double quantisation (QLoRA)")
    probe.add_argument("--lora-r", type=_positive_int, help="LoRA rank (no LoRA without it)")
    probe.add_argument("--lora-alpha", type=_positive_int, help="LoRA alpha (default: 2 x r)")
    probe.add_argument("--lora-target", default="q_proj,v_proj", help="comma-separated module names")
    probe.add_argument(
        "--no-gradient-checkpointing",
        action="store_true",
        help="probe without gradient checkpointing (the run must then train without it too)",
    )
    probe.add_argument("--optim", help="a TrainingArguments.optim name (default: the Trainer's default)")
    probe.add_argument(
        "--effective-batch",
        type=_positive_int,
        help="also print per-device x accumulation for this many samples per step",
    )
    probe.add_argument("--gpus", type=_positive_int, default=1, help="GPUs sharing the effective batch")
    probe.add_argument("--headroom", type=float, default=0.05, help="share of GPU memory to keep free")
    probe.add_argument("--max", action="store_true", help="recommend the largest size that fits")
    probe.add_argument("--max-size", type=_positive_int, default=4096, help="largest size to try")
    probe.add_argument("--cpu", action="store_true", help="probe on the CPU (needs --memory-budget)")
    probe.add_argument(
        "--memory-budget",
        type=float,
        help="GiB a training step may use (required with --cpu; on a GPU, a cap)",
    )
    probe.add_argument("--no-cache", action="store_true", help="do not write the result to the cache")
    probe.add_argument("--json", action="store_true", help="one JSON object on stdout")

    plan = commands.add_parser(
        "plan",
        help="print the steps, samples, tokens and LR of a run before it starts",
        formatter_class=_HelpFormatter,
    )
    data = plan.add_mutually_exclusive_group(required=True)
    data.add_argument("--dataset-size", type=_positive_int, help="training samples")
    data.add_argument("--dataset", type=Path, help="a .jsonl/.json file or a datasets.save_to_disk folder")
    plan.add_argument(
        "--tokenizer",
        type=Path,
        help="a tokenizer folder (save_pretrained): count the tokens of --dataset rows that hold 'text' or "
        "'messages' (chat template) rather than 'input_ids'",
    )
    plan.add_argument(
        "--args",
        type=Path,
        help="the run's saved TrainingArguments: a JSON of them (args.to_json_string()) or the training_args.bin "
        "the Trainer writes in each checkpoint (unpickled: only your own files); the flags below override it",
    )
    plan.add_argument(
        "script_args",
        nargs="*",
        metavar="-- SCRIPT ARGS",
        help="after --, your script's own command-line arguments (HfArgumentParser style, e.g. "
        "--per_device_train_batch_size 4 --num_train_epochs 2); the TrainingArguments fields among them override "
        "--args, the rest are ignored",
    )
    plan.add_argument(
        "--per-device", type=_positive_int, help="per_device_train_batch_size (default: --args, else 8)"
    )
    plan.add_argument(
        "--accumulation", type=_positive_int, help="gradient_accumulation_steps (default: --args, else 1)"
    )
    plan.add_argument("--gpus", type=_positive_int, default=1, help="data-parallel processes (world size)")
    plan.add_argument("--epochs", type=float, help="num_train_epochs (default: --args, else the Trainer's 3)")
    plan.add_argument(
        "--max-steps",
        type=int,
        help="max_steps (overrides --epochs, as in the Trainer; default: --args, else -1: not set)",
    )
    plan.add_argument(
        "--schedule",
        help="effective batch per phase, e.g. 8,16,32 (default: per-device x accumulation x gpus)",
    )
    plan.add_argument(
        "--boundaries", default="", help="where phases 2.. start, e.g. 0.1,0.3 (default: none, one phase)"
    )
    plan.add_argument(
        "--unit",
        choices=("fraction", "samples", "steps"),
        default="fraction",
        help="what --boundaries count: a fraction of the budget, samples or optimizer steps",
    )
    plan.add_argument(
        "--lr-scaling",
        choices=("none", "sqrt", "linear"),
        default="none",
        help="LR multiplier when the batch grows: sqrt (Adam family), linear (SGD) or none",
    )
    plan.add_argument(
        "--drop-last", action="store_true", help="dataloader_drop_last (default: --args, else off)"
    )
    plan.add_argument("--json", action="store_true", help="one JSON object on stdout")

    plot = commands.add_parser(
        "plot",
        help="draw a run's batch sizes, noise scale, LR and loss against samples seen (PNG)",
        formatter_class=_HelpFormatter,
    )
    plot.add_argument(
        "run_dir",
        type=Path,
        help="a Trainer output_dir (its trainer_state.json, else its newest checkpoint's) or a trainer_state.json",
    )
    plot.add_argument("--out", type=Path, help="the PNG to write (default: RUN_DIR/adaptive_batch.png)")
    plot.add_argument("--json", action="store_true", help="one JSON object on stdout")
    return parser


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows every option's default after its help text, except where there is none to show (`None`, a
    switch's `False`, an empty string): those options say in their help what happens without them."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == "":
            return action.help
        return super()._get_help_string(action)


# the plan's flags, the TrainingArguments field each reads from --args, and its default without either
RUN_SETTINGS = (
    ("per_device", "per_device_train_batch_size", 8),
    ("accumulation", "gradient_accumulation_steps", 1),
    ("epochs", "num_train_epochs", None),
    ("max_steps", "max_steps", -1),
    ("drop_last", "dataloader_drop_last", False),
)


def read_training_args(path: Path) -> dict:
    """The fields of a saved TrainingArguments: a JSON object of them, or a `training_args.bin`."""
    if not path.exists():
        raise ValueError(
            f"--args {path} does not exist; pass a TrainingArguments JSON or a training_args.bin."
        )
    if path.suffix == ".bin":
        import torch

        saved = torch.load(path, weights_only=False)  # a pickled TrainingArguments, the Trainer's own format
        fields = saved.to_dict() if hasattr(saved, "to_dict") else None
    else:
        try:
            fields = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(
                f"--args {path} is not JSON ({error}); pass args.to_json_string() saved to a file."
            ) from None
    if not isinstance(fields, dict) or "per_device_train_batch_size" not in fields:
        raise ValueError(
            f"--args {path} holds no TrainingArguments (no per_device_train_batch_size); save them with "
            "open(path, 'w').write(args.to_json_string()), or pass a checkpoint's training_args.bin."
        )
    return fields


def read_script_args(argv: list[str]) -> dict:
    """The TrainingArguments fields the plan reads, from a script's command line as HfArgumentParser takes it
    (`--per_device_train_batch_size 4` or `--per-device-train-batch-size=4`, a bool as a bare flag or with a
    value); every other argument is ignored."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    types = {"per_device_train_batch_size": int, "gradient_accumulation_steps": int, "max_steps": int}
    for _, field, _ in RUN_SETTINGS:
        names = [f"--{field}", f"--{field.replace('_', '-')}"]
        if field == "dataloader_drop_last":
            parser.add_argument(*names, dest=field, nargs="?", const="true", type=str)
        else:
            parser.add_argument(*names, dest=field, type=types.get(field, float))
    try:
        known, _ = parser.parse_known_args(argv)
    except SystemExit:
        raise ValueError(
            f"The script arguments {' '.join(argv)!r} give one of {fields_text()} no valid value."
        ) from None
    fields = {field: value for field, value in vars(known).items() if value is not None}
    if "dataloader_drop_last" in fields:
        fields["dataloader_drop_last"] = fields["dataloader_drop_last"].lower() in ("true", "1", "yes")
    return fields


def fields_text() -> str:
    return ", ".join(field for _, field, _ in RUN_SETTINGS)


def apply_training_args(options: argparse.Namespace) -> None:
    """Fill the plan's settings left unset on the command line from the script's arguments (after --), then from
    --args, then from the defaults."""
    fields = read_training_args(options.args) if options.args is not None else {}
    fields.update(read_script_args(getattr(options, "script_args", None) or []))
    for flag, field, default in RUN_SETTINGS:
        given = getattr(options, flag)
        if given is None or (flag == "drop_last" and not given):
            setattr(options, flag, fields.get(field, default))


def plan_command(options: argparse.Namespace) -> dict:
    """Build the plan the Trainer would run and return it as plain data (printed by `main`)."""
    apply_training_args(options)
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
        "uneven_steps": [  # an epoch's short last step, or one holding a remainder too small for every rank
            {"step": step, "samples": samples, "scheduled": scheduled, "lr_multiplier": clock.scale(step)}
            for step, samples, scheduled in plan.uneven_steps()
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


def probe_command(options: argparse.Namespace) -> dict:
    """Load the model as the run would, probe it, cache the result and return the report as plain data."""
    import torch

    from ..probe import cache as probe_cache
    from ..probe import load
    from ..probe import search as probe

    _check_memory_budget(options.memory_budget)
    if options.cpu:
        if options.memory_budget is None:
            raise ValueError("--cpu needs --memory-budget GIB: on the CPU the limit is a stated budget.")
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        raise ValueError(
            "no CUDA device; pass --cpu --memory-budget GIB to probe on the CPU against a budget."
        )
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    if not 0 <= options.headroom < 1:
        raise ValueError(f"--headroom {options.headroom} must be in [0, 1), e.g. 0.05.")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[options.dtype]
    targets = [t.strip() for t in options.lora_target.split(",") if t.strip()]
    gradient_checkpointing = not options.no_gradient_checkpointing
    model = load.load_model(
        options.model_dir,
        dtype,
        options.load_in_4bit,
        options.lora_r,
        options.lora_alpha,
        targets,
        gradient_checkpointing,
        options.seq_len,
        device,
    )
    optim = options.optim or probe_cache.default_optim()
    setup = probe_cache.describe_setup(model, optim, gradient_checkpointing)
    with _progress() as on_trial:
        report = probe.probe(
            model,
            options.seq_len,
            optim=optim,
            device=device,
            headroom=options.headroom,
            memory_budget=options.memory_budget * 2**30 if options.memory_budget is not None else None,
            max_size=options.max_size,
            largest=options.max,
            effective_batch_size=options.effective_batch,
            gpus=options.gpus,
            autocast_dtype=dtype if dtype != torch.float32 else None,
            setup=setup,
            on_trial=on_trial,
        )
    result = report.to_dict()
    if not options.no_cache:
        result["cache_file"] = str(probe_cache.save_report(report))
    return result


def plot_command(options: argparse.Namespace) -> dict:
    """Draw the run into a PNG and return where it went, with what was read."""
    from . import plot

    state_file = plot.find_trainer_state(options.run_dir)
    series = plot.read_series(plot.load_log_history(state_file), source=str(state_file))
    png = plot.write_png(series, options.out or plot.default_png(options.run_dir))
    return {
        "png": str(png),
        "trainer_state": str(state_file),
        "logged_steps": len(series.step),
        "last_step": series.step[-1],
        "samples_seen": series.samples_seen[-1],
        "evaluations": len(series.eval_loss),
        "noise_scale_measured": series.noise_measured,
    }


def _check_memory_budget(memory_budget: float | None) -> None:
    """Refuse a budget no step can run under, before any model is loaded."""
    if memory_budget is not None and not (math.isfinite(memory_budget) and memory_budget > 0):
        raise ValueError(
            f"--memory-budget {memory_budget:g} is not a positive, finite number of GiB (the memory a training step "
            "may use); pass one such as --memory-budget 8."
        )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    options = parser.parse_args(argv)
    command = {"plan": plan_command, "probe": probe_command, "plot": plot_command}[options.command]
    try:
        result = command(options)
    except (ValueError, OSError, ImportError) as error:
        print(f"adaptive-batch: error: {error}", file=sys.stderr)
        return 1
    if options.json:
        print(
            json.dumps({key: value for key, value in result.items() if key != "table"}, indent=1, default=str)
        )
    elif options.command == "plan":
        _print_plan(result)
    elif options.command == "plot":
        print(
            f"{result['png']}: {result['logged_steps']} logged steps to step {result['last_step']}, "
            f"{result['samples_seen']:,} samples (from {result['trainer_state']})"
        )
    else:
        _print_probe(result)
    return 0


def _print_probe(result: dict) -> None:
    lines = [f"{'size':>6} {'fits':>5} {'peak GiB':>9} {'allocated':>9} {'tokens/s':>10}"]
    for trial in result["trials"]:
        fits = "OOM" if trial["out_of_memory"] else "yes" if trial["fits"] else "over"
        speed = f"{trial['tokens_per_second']:,.0f}" if trial["tokens_per_second"] else "-"
        speed = "~" + speed if trial.get("forward_only") else speed
        more = ">" if trial["stopped"] else ""  # stopped at the limit: the peak it reached by then
        lines.append(
            f"{trial['size']:>6} {fits:>5} {more + format_gib(trial['peak_bytes']):>9} "
            f"{more + format_gib(trial['peak_allocated_bytes']):>9} {speed:>10}"
        )
    if any(trial.get("forward_only") for trial in result["trials"]):
        lines.append("~ its forward pass timed, scaled to a whole step by the boundary's step/forward ratio")
    print("\n".join(lines))
    print(
        f"boundary: {result['boundary']} samples ({result['boundary_tokens']:,} tokens) per micro-batch, "
        f"limit {format_gib(result['limit_bytes'])} GiB"
    )
    print(f"recommended: {result['recommended']} ({result['recommended_by']})")
    print(
        "variable-length data: AdaptiveBatch() cuts steps by padded tokens itself; at most "
        f"{result['boundary_tokens']:,} fit in one micro-batch "
        f"(AdaptiveBatch(max_tokens_per_micro_batch={result['boundary_tokens']}) states that budget)"
    )
    if result["effective_batch_size"]:
        print(
            f"for an effective batch of {result['effective_batch_size']} on "
            f"{devices_text(result.get('device'), result['gpus'])}: "
            f"per_device_train_batch_size={result['per_device_train_batch_size']}, "
            f"gradient_accumulation_steps={result['gradient_accumulation_steps']}"
        )
        if result.get("split_reason"):
            print(f"  {result['split_reason']}")
    print(
        f"time: {result['seconds']:.1f} s: warm-up {result['warm_up_seconds']:.1f} s, trials "
        f"{result['trial_seconds']:.1f} s, the rest {result['overhead_seconds']:.1f} s"
    )
    if result.get("cache_file"):
        print(f"cached in {result['cache_file']}", file=sys.stderr)


def devices_text(device: str | None, gpus: int) -> str:
    """What the effective batch is shared across, in words: "the CPU", "1 GPU", "2 GPUs"."""
    if device == "cpu":
        return "the CPU" if gpus == 1 else f"{gpus} CPU processes"
    return f"{gpus} GPU" if gpus == 1 else f"{gpus} GPUs"


def format_gib(value: float | None) -> str:
    """Bytes as GiB with two decimals below 10 GiB, one above; "-" for no reading."""
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value / 2**30:.2f}" if value < 10 * 2**30 else f"{value / 2**30:.1f}"


@contextlib.contextmanager
def _progress():
    """A progress line per trial on stderr (rich where installed); yields the per-trial callback."""
    try:
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    except ImportError:

        def report(trial):
            print(f"trial {trial.size}: {_outcome(trial)}", file=sys.stderr)

        yield report
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("probing", total=None)

        def report(trial):
            progress.update(
                task,
                description=f"probing: last trial {trial.size} ({_outcome(trial)})",
            )

        yield report


def _outcome(trial) -> str:
    return "out of memory" if trial.out_of_memory else "stopped over the limit" if trial.stopped else "ran"


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
        tokens = lengths.total_tokens(dataset)
        if tokens is None and options.tokenizer is not None:
            tokens = _count_tokens(dataset, options.tokenizer, path)
        return len(dataset), tokens
    records = _read_records(path)
    if not records:
        raise ValueError(f"--dataset {path} holds no records.")
    with_ids = [
        r["input_ids"] for r in records if isinstance(r, dict) and isinstance(r.get("input_ids"), list)
    ]
    if len(with_ids) == len(records):
        return len(records), sum(map(len, with_ids))
    if options.tokenizer is not None:
        return len(records), _count_tokens(records, options.tokenizer, path)
    return len(records), None


def _count_tokens(rows, tokenizer_dir: Path, path: Path) -> int:
    """Tokens of rows holding 'text' (tokenized as is) or 'messages' (the tokenizer's chat template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    total = 0
    for index, row in enumerate(rows):
        if isinstance(row, dict) and isinstance(row.get("text"), str):
            total += len(tokenizer(row["text"])["input_ids"])
        elif isinstance(row, dict) and isinstance(row.get("messages"), list):
            total += len(tokenizer.apply_chat_template(row["messages"], tokenize=True))
        else:
            raise ValueError(
                f"--dataset {path} row {index} holds neither 'input_ids', 'text' nor 'messages', so --tokenizer "
                "has nothing to count; pass a dataset of those, or leave --tokenizer out (tokens unknown)."
            )
    return total


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
