"""`adaptive-batch probe`: load the model as the run would, find the largest micro-batch that fits and the fastest
one, cache the result for `AdaptiveBatch(micro_batch_size="auto")` and print the trials as a table."""

from __future__ import annotations

import argparse
import contextlib
import math
import sys

from .arguments import positive_int

HELP = "find the largest micro-batch that fits, and the fastest one"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("model_dir", help="a folder written by save_pretrained")
    add("--seq-len", type=positive_int(1024), required=True, help="tokens per sample")
    add("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="weights / compute dtype")
    add("--load-in-4bit", action="store_true", help="NF4 with double quantisation (QLoRA)")
    add("--lora-r", type=positive_int(16), help="LoRA rank (no LoRA without it)")
    add("--lora-alpha", type=positive_int(32), help="LoRA alpha (default: 2 x r)")
    add("--lora-target", default="q_proj,v_proj", help="comma-separated module names")
    add(
        "--no-gradient-checkpointing",
        action="store_true",
        help="probe without gradient checkpointing (the run must then train without it too)",
    )
    add("--optim", help="a TrainingArguments.optim name (default: the Trainer's default)")
    add(
        "--effective-batch",
        type=positive_int(64),
        help="also print per-device x accumulation for this many samples per step",
    )
    add("--gpus", type=positive_int(2), default=1, help="GPUs sharing the effective batch")
    add("--headroom", type=float, default=0.05, help="share of GPU memory to keep free")
    add("--max", action="store_true", help="recommend the largest size that fits")
    add("--max-size", type=positive_int(4096), default=4096, help="largest size to try")
    add("--cpu", action="store_true", help="probe on the CPU (needs --memory-budget)")
    add(
        "--memory-budget",
        type=float,
        help="GiB a training step may use (required with --cpu; on a GPU, a cap)",
    )
    add("--no-cache", action="store_true", help="do not write the result to the cache")
    add(
        "--no-eval",
        action="store_true",
        help="skip the search for the largest eval batch (a forward without gradients beside the training state)",
    )


def run(options: argparse.Namespace) -> dict:
    """Load the model as the run would, probe it, cache the result and return the report as plain data."""
    import torch

    from ..probe import cache as probe_cache
    from ..probe import load, search

    budget = options.memory_budget
    if budget is not None and not (math.isfinite(budget) and budget > 0):  # before any model is loaded
        raise ValueError(
            f"--memory-budget {budget:g} is not a positive, finite number of GiB (the memory a training step "
            "may use); pass one such as --memory-budget 8."
        )
    if options.cpu and budget is None:
        raise ValueError("--cpu needs --memory-budget GIB: on the CPU the limit is a stated budget.")
    if not options.cpu and not torch.cuda.is_available():
        raise ValueError(
            "no CUDA device; pass --cpu --memory-budget GIB to probe on the CPU against a budget."
        )
    device = torch.device("cpu") if options.cpu else torch.device("cuda", torch.cuda.current_device())
    if not 0 <= options.headroom < 1:
        raise ValueError(f"--headroom {options.headroom} must be in [0, 1), e.g. 0.05.")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[options.dtype]
    gradient_checkpointing = not options.no_gradient_checkpointing
    model = load.load_model(
        options.model_dir,
        dtype,
        options.load_in_4bit,
        options.lora_r,
        options.lora_alpha,
        [t.strip() for t in options.lora_target.split(",") if t.strip()],
        gradient_checkpointing,
        options.seq_len,
        device,
    )
    optim = options.optim or probe_cache.default_optim()
    with _progress() as on_trial:
        report = search.probe(
            model,
            options.seq_len,
            optim=optim,
            device=device,
            headroom=options.headroom,
            memory_budget=budget * 2**30 if budget is not None else None,
            max_size=options.max_size,
            largest=options.max,
            effective_batch_size=options.effective_batch,
            gpus=options.gpus,
            autocast_dtype=dtype if dtype != torch.float32 else None,
            setup=probe_cache.describe_setup(model, optim, gradient_checkpointing),
            on_trial=on_trial,
            evaluation=not options.no_eval,
        )
    result = report.to_dict()
    if not options.no_cache:
        result["cache_file"] = str(probe_cache.save_report(report))
    return result


def show(result: dict) -> None:
    """The trials as a table, then the boundary, the recommendation and the split of an effective batch."""
    print(f"{'size':>6} {'fits':>5} {'peak GiB':>9} {'allocated':>9} {'tokens/s':>10}")
    for trial in result["trials"]:
        fits = "OOM" if trial["out_of_memory"] else "yes" if trial["fits"] else "over"
        speed = f"{trial['tokens_per_second']:,.0f}" if trial["tokens_per_second"] else "-"
        speed = "~" + speed if trial.get("forward_only") else speed
        more = ">" if trial["stopped"] else ""  # stopped at the limit: the peak it reached by then
        print(
            f"{trial['size']:>6} {fits:>5} {more + format_gib(trial['peak_bytes']):>9} "
            f"{more + format_gib(trial['peak_allocated_bytes']):>9} {speed:>10}"
        )
    if any(trial.get("forward_only") for trial in result["trials"]):
        print("~ its forward pass timed, scaled to a whole step by the boundary's step/forward ratio")
    # without a trial that failed, the search stopped at --max-size: the boundary is at least that
    at_least = "at least " if result["first_failing"] is None else ""
    print(
        f"boundary: {at_least}{result['boundary']} samples ({at_least}{result['boundary_tokens']:,} tokens) per "
        f"micro-batch, limit {format_gib(result['limit_bytes'])} GiB"
    )
    print(f"recommended: {result['recommended']} ({result['recommended_by']})")
    if result.get("eval_boundary") is not None:
        more = "at least " if result["eval_first_failing"] is None else ""
        print(
            f"eval batch: {more}{result['eval_boundary']} samples fit one forward without gradients beside the "
            f"training state (per_device_eval_batch_size={result['eval_boundary']}; AdaptiveBatch runs an eval "
            "batch that does not fit in pieces)"
        )
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
    """Bytes as GiB: two significant digits below 0.01, two decimals below 10, one above; "-" for no reading."""
    if value is None or not math.isfinite(value):
        return "-"
    gib = value / 2**30
    return f"{gib:.2g}" if gib < 0.01 else f"{gib:.2f}" if gib < 10 else f"{gib:.1f}"


@contextlib.contextmanager
def _progress():
    """A progress line per trial on stderr (rich where installed); yields the per-trial callback."""
    try:
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    except ImportError:
        yield lambda trial: print(f"trial {trial.size}: {_outcome(trial)}", file=sys.stderr)
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("probing", total=None)
        yield lambda trial: progress.update(
            task, description=f"probing: last trial {trial.size} ({_outcome(trial)})"
        )


def _outcome(trial) -> str:
    return "out of memory" if trial.out_of_memory else "stopped over the limit" if trial.stopped else "ran"
