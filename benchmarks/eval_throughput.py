"""Evaluation speed: the seconds of `Trainer.evaluate()` over an eval set of SFT-like lengths, the plain Trainer at
`per_device_eval_batch_size` 8 (the default) and at larger fixed sizes, against `AdaptiveBatch()` (which keeps the
eval batch and only survives out-of-memory errors) and `AdaptiveBatch(adapt_evaluation="grow")` over repeated
evaluations, arms interleaved in one process.

The setup is qlora_throughput.py's (Llama-2-7B shape with random weights, NF4 QLoRA, LoRA r=16 on q/v, gradient
checkpointing, paged 8-bit AdamW, sdpa attention). The eval set: `--rows` rows whose lengths follow
ragged_throughput.py's distribution (lognormal, median 200, clipped to [16, 1,024]), random token ids, a padding
collator (right padding to the longest row of each batch), no `compute_metrics` (the Trainer then keeps no logits:
an evaluation during training as most scripts run it).

Arms (`--arms`, in `--rounds` rounds (default 2), every other one in reverse order; before its first timed run each
arm runs `--warmup-evaluations` (default 1) unrecorded evaluations of its own on a Trainer of its own, see
rounds.py):
- `plain_N`: the plain Trainer, `per_device_eval_batch_size=N` (`--sizes`, default 8,16,32,64,128), two evaluations;
- `auto`: `AdaptiveBatch()` at 8, two evaluations;
- `grow`: `AdaptiveBatch(adapt_evaluation="grow")` from 8, `--evaluations` evaluations in a row on one Trainer; the
  sizes it ran and its log lines are recorded. Its "settled" seconds: the evaluations after it settled.

Each arm's evaluations are timed with the device synchronised (wall seconds of `evaluate()`), peak memory recorded.
The summary: seconds per evaluation of each arm (pooled over rounds), the best plain size, and for `grow` its
settled seconds against plain 8 and against the best plain size, and the eval loss of each arm (the same model: the
grown batches' eval loss differs from plain 8's only through the Trainer's mean of per-batch means on ragged rows).

Usage (results go to OUT/eval_throughput.json, written after every arm, and a table at the end):

    python3 benchmarks/eval_throughput.py --out $OUT --time-limit 300
    python benchmarks/eval_throughput.py --out /tmp/out --tiny     # a CPU dry run of the same code on a tiny model

`--time-limit S` starts no arm that would end after S seconds (judged by the longest arm so far; its warm-up not
counted).
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch
from base_model import header, qlora_trainer
from common import Deadline, build_model, save, sync
from ragged_throughput import CountingCollator, lengths
from rounds import WarmUps, add_arguments, interleaved


class LogLines(logging.Handler):
    """Keeps AdaptiveBatch's log lines about the eval batch."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if "Eval batch" in message or "out of memory" in message:
            self.lines.append(message)


def run_arm(name, model, rows, tiny, workdir, evaluations, repeats=None):
    """The arm `name` on a Trainer of its own: `repeats` evaluations in a row (default: two, `evaluations` for
    grow)."""
    from adaptive_batch import AdaptiveBatch

    if name.startswith("plain_"):
        size, callbacks = int(name.split("_")[1]), []
    else:
        size = 8
        callbacks = [AdaptiveBatch(adapt_evaluation="grow" if name == "grow" else True)]
    if repeats is None:
        repeats = evaluations if name == "grow" else 2
    collator = CountingCollator("pad")
    trainer = qlora_trainer(
        model,
        rows,
        callbacks,
        os.path.join(workdir, name),
        per_device=1,
        accumulation=1,
        steps=1,
        tiny=tiny,
        data_collator=collator,
        per_device_eval_batch_size=size,
        eval_strategy="no",
    )
    trainer.eval_dataset = rows
    lines = LogLines()
    logging.getLogger("adaptive_batch").addHandler(lines)
    record = {"arm": name, "evaluations": []}
    try:
        for _ in range(repeats):
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            sync()
            started = time.perf_counter()
            metrics = trainer.evaluate()
            sync()
            record["evaluations"].append(
                {
                    "seconds": time.perf_counter() - started,
                    "eval_loss": metrics["eval_loss"],
                    "batch_size": metrics.get("eval_adaptive_batch/micro_batch_size", size),
                    "batches_retried": metrics.get("eval_adaptive_batch/batches_retried", 0),
                    "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30
                    if torch.cuda.is_available()
                    else None,
                }
            )
    finally:
        logging.getLogger("adaptive_batch").removeHandler(lines)
    record["log"] = lines.lines
    if name == "grow":
        from adaptive_batch.testing import eval_growth

        growth = eval_growth(trainer)  # (the benchmark reads where it settled)
        sizer = growth.sizer("eval")
        record["settled_because"] = sizer.settled_because
        record["history"] = sizer.history
    del trainer
    return record


def settled_seconds(record) -> list[float]:
    """The grow arm's evaluations after its size settled: those run at the size it kept, after the first
    evaluation at that size that came after the last change."""
    runs = record["evaluations"]
    final = runs[-1]["batch_size"]
    start = len(runs) - 1
    while start > 0 and runs[start - 1]["batch_size"] == final:
        start -= 1
    return [run["seconds"] for run in runs[start:]]


def summarise(report):
    pooled: dict[str, list[float]] = {}
    losses: dict[str, float] = {}
    for record in report["runs"]:
        name = record["arm"]
        seconds = settled_seconds(record) if name == "grow" else [r["seconds"] for r in record["evaluations"]]
        pooled.setdefault(name, []).extend(seconds)
        losses[name] = record["evaluations"][-1]["eval_loss"]
    summary = {
        name: {"seconds": sum(values) / len(values), "evaluations": len(values), "eval_loss": losses[name]}
        for name, values in pooled.items()
    }
    plain = {name: value for name, value in summary.items() if name.startswith("plain_")}
    if plain:
        best = min(plain, key=lambda name: plain[name]["seconds"])
        summary["best_plain"] = best
        for name in ("auto", "grow"):
            if name in summary:
                summary[name]["over_best_plain"] = summary[best]["seconds"] / summary[name]["seconds"]
                if "plain_8" in summary:
                    summary[name]["over_plain_8"] = summary["plain_8"]["seconds"] / summary[name]["seconds"]
    grow_runs = [record for record in report["runs"] if record["arm"] == "grow"]
    if grow_runs:
        summary["grow_sizes"] = [[r["batch_size"] for r in record["evaluations"]] for record in grow_runs]
        summary["grow_first_seconds"] = [record["evaluations"][0]["seconds"] for record in grow_runs]
    report["summary"] = summary


def print_table(report):
    summary = report["summary"]
    print(f"\n{'arm':>10}  {'s / eval':>9}  {'evals':>5}  {'eval loss':>9}")
    for name, value in summary.items():
        if isinstance(value, dict):
            print(
                f"{name:>10}  {value['seconds']:9.2f}  {value['evaluations']:5d}  {value['eval_loss']:9.4f}"
            )
    for name in ("auto", "grow"):
        if name in summary and "over_plain_8" in summary[name]:
            print(
                f"{name}: x{summary[name]['over_plain_8']:.2f} the speed of plain_8, "
                f"x{summary[name]['over_best_plain']:.2f} the best plain size ({summary['best_plain']})"
            )
    if "grow_sizes" in summary:
        print(f"grow's eval batches, each round: {summary['grow_sizes']}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="a CPU dry run on a tiny model")
    parser.add_argument("--rows", type=int, help="eval rows (default 1024; 96 with --tiny)")
    parser.add_argument("--sizes", default="8,16,32,64,128", help="the plain arms' eval batch sizes")
    parser.add_argument("--arms", help="comma-separated (default: every plain size, auto, grow)")
    parser.add_argument("--evaluations", type=int, default=6, help="evaluations of the grow arm in a row")
    add_arguments(parser, unit="evaluations")
    parser.add_argument(
        "--time-limit", type=float, default=0, help="start no arm that would end after this (s)"
    )
    parser.add_argument("--workdir", default="/tmp/adaptive-batch-bench")
    options = parser.parse_args()
    os.makedirs(options.out, exist_ok=True)
    os.makedirs(options.workdir, exist_ok=True)
    deadline = Deadline(options.time_limit)

    model, config = build_model(options.tiny, options.workdir)
    count = options.rows or (96 if options.tiny else 1024)
    row_lengths = lengths(count, seed=2)
    if options.tiny:
        row_lengths = [max(4, n // 16) for n in row_lengths]
    generator = torch.Generator().manual_seed(3)
    rows = [
        {"input_ids": torch.randint(1, config.vocab_size, (n,), generator=generator).tolist()}
        for n in row_lengths
    ]
    arms = (
        options.arms or ",".join([f"plain_{s}" for s in options.sizes.split(",")] + ["auto", "grow"])
    ).split(",")
    report = {
        **header(options.tiny),
        "eval_rows": count,
        "eval_tokens": sum(row_lengths),
        "longest_row": max(row_lengths),
        "runs": [],
        "left_out": [],
    }
    # an arm's first evaluation pays for its shapes and kernels (the process's first, for the process's): not its cost
    warm_ups = WarmUps(options.warmup_evaluations, unit="evaluations")
    report["warmup"] = warm_ups.record()
    path = os.path.join(options.out, "eval_throughput.json")
    for round_, name in interleaved(arms, options.rounds):
        if not deadline.allows_another():
            report["left_out"].append(f"{name} (round {round_})")
            continue
        warm_ups.before(
            name, run_arm, name, model, rows, options.tiny, options.workdir, 1, options.warmup_evaluations
        )
        record = deadline.run(run_arm, name, model, rows, options.tiny, options.workdir, options.evaluations)
        record["round"] = round_
        report["runs"].append(record)
        save(report, path)
        sizes = [r["batch_size"] for r in record["evaluations"]]
        seconds = ", ".join(f"{r['seconds']:.2f}" for r in record["evaluations"])
        print(f"{name:>10} (round {round_}): eval batches {sizes}, seconds {seconds}", flush=True)
    summarise(report)
    save(report, path)
    print_table(report)


if __name__ == "__main__":
    main()
