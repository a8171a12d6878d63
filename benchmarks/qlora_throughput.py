"""QLoRA throughput: the plain Trainer at fixed per-device x accumulation pairs against `AdaptiveBatch`, one process.

The setup is the classic QLoRA recipe on a Llama-2-7B-shaped model (random weights: speed and memory do not depend
on them): NF4 with double quantisation and bf16 compute, LoRA r=16 on q/v, gradient checkpointing,
`paged_adamw_8bit`, fixed-length sequences. Every configuration has the same effective batch.

Measured per configuration: the wall time of each optimizer step (device synchronised at every step end), tokens
per second over the steps after the first (warm-up), and the peak memory. The configurations run in `--rounds`
rounds (default 2), every other one in reverse order, and each trains `--warmup-steps` (default 1) unrecorded steps
of its own before its first timed run (see rounds.py); the summary pools each configuration's rounds and compares
every one over the steps after its first (AdaptiveBatch's search included), the steady speed beside. Two claims are
checked:

1. overhead: with `AdaptiveBatch(micro_batch_size=<the user's per-device size>)` the step time is within 2% of the
   plain Trainer's at the same pair;
2. auto: from the user's 1 x 64, `AdaptiveBatch()` reaches at least 95% of the tokens/s of the best fixed pair.

Usage (results go to OUT/qlora_throughput.json, written after every configuration, and a table at the end):

    python benchmarks/qlora_throughput.py --out OUT            # the H200 run (needs CUDA and bitsandbytes)
    python benchmarks/qlora_throughput.py --out OUT --tiny     # a CPU dry run of the same code on a tiny model
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
from base_model import header, qlora_trainer
from common import StepClock, build_model, save  # ragged_throughput.py imports the first two from here
from rounds import WarmUps, add_arguments, interleaved


def run_config(model, dataset, seq_len, per_device, accumulation, steps, adaptive, tiny, workdir):
    from adaptive_batch import AdaptiveBatch

    clock = StepClock()
    callbacks = [clock.callback]
    callback = AdaptiveBatch(**adaptive) if adaptive is not None else None
    if callback is not None:
        callbacks.append(callback)
    trainer = qlora_trainer(
        model,
        dataset,
        callbacks,
        os.path.join(workdir, "trainer"),
        per_device,
        accumulation,
        steps,
        tiny,
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    seconds = clock.step_seconds
    effective = per_device * accumulation
    timed = seconds[1:] if len(seconds) > 1 else seconds
    logs = [log for log in trainer.state.log_history if "loss" in log]
    result = {
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": accumulation,
        "adaptive_batch": adaptive,
        "steps": len(seconds),
        "step_seconds": seconds,
        "tokens_per_step": effective * seq_len,
        "tokens_per_second_after_first_step": effective * seq_len * len(timed) / sum(timed),
        "tokens_per_second_all_steps": effective * seq_len * len(seconds) / sum(seconds),
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30
        if torch.cuda.is_available()
        else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else None,
        "micro_batch_size_per_step": [log.get("adaptive_batch/micro_batch_size") for log in logs],
        "accumulation_steps_per_step": [log.get("adaptive_batch/accumulation_steps") for log in logs],
        "effective_batch_size_per_step": [log.get("adaptive_batch/effective_batch_size") for log in logs],
    }
    if callback is not None:
        now = callback.current()
        result["current"] = now
        # what the micro-batch search measured (its state as a checkpoint stores it), for the summary and the plot
        result["controller"] = callback.state()["attributes"]["checkpoint"]["micro_batch"]
        settled_size = now["micro_batch_size"]
        settled = [i for i, m in enumerate(result["micro_batch_size_per_step"]) if m == settled_size]
        # steady state: the steps after the last one that still explored
        sizes = result["micro_batch_size_per_step"]
        done = now["micro_batch_settled_because"] is not None
        first_steady = next(
            (i for i in range(len(logs)) if done and all(m == settled_size for m in sizes[i:])),
            None,
        )
        steady = seconds[max(first_steady, 1) :] if first_steady is not None else []
        result["first_steady_step"] = first_steady
        result["tokens_per_second_steady"] = (
            effective * seq_len * len(steady) / sum(steady) if steady else None
        )
        result["settled_steps"] = settled
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def parse_pairs(text: str) -> list[tuple[int, int, int]]:
    """'1x64:2,8x8:4' -> [(1, 64, 2), (8, 8, 4)] (per-device x accumulation : steps)."""
    pairs = []
    for item in text.split(","):
        pair, steps = item.split(":")
        per_device, accumulation = pair.split("x")
        pairs.append((int(per_device), int(accumulation), int(steps)))
    return pairs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="a CPU dry run on a tiny model")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument(
        "--plain",
        default="1x64:2,8x8:4,16x4:4,32x2:3,64x1:3",
        help="plain Trainer pairs, per-device x accumulation : steps",
    )
    parser.add_argument(
        "--overhead",
        default="8x8:4,16x4:4",
        help="pairs run with AdaptiveBatch(micro_batch_size=per-device) : steps",
    )
    parser.add_argument("--auto", default="1x64:6", help="pairs run with AdaptiveBatch() : steps")
    parser.add_argument("--workdir", default="/tmp/adaptive-batch-bench")
    add_arguments(parser)
    options = parser.parse_args()
    os.makedirs(options.out, exist_ok=True)
    os.makedirs(options.workdir, exist_ok=True)

    model, config = build_model(options.tiny, options.workdir)
    pairs = parse_pairs(options.plain) + parse_pairs(options.overhead) + parse_pairs(options.auto)
    largest = max(p * a * max(s, options.warmup_steps) for p, a, s in pairs)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (largest, options.seq_len), generator=generator).tolist()
    dataset = [{"input_ids": row, "attention_mask": [1] * options.seq_len, "labels": row} for row in ids]

    report = {
        **header(options.tiny),
        "seq_len": options.seq_len,
        "runs": [],
    }
    path = os.path.join(options.out, "qlora_throughput.json")
    plans = [("plain", p, None) for p in parse_pairs(options.plain)]
    plans += [("fixed", p, {"micro_batch_size": p[0]}) for p in parse_pairs(options.overhead)]
    plans += [("auto", p, {}) for p in parse_pairs(options.auto)]
    by_name = {f"{kind} {p[0]}x{p[1]}": (kind, p, adaptive) for kind, p, adaptive in plans}
    warm_ups = WarmUps(options.warmup_steps)
    report["warmup"] = warm_ups.record()
    for round_, name in interleaved(list(by_name), options.rounds):
        kind, (per_device, accumulation, steps), adaptive = by_name[name]
        warm_ups.before(
            name,
            run_config,
            model,
            dataset,
            options.seq_len,
            per_device,
            accumulation,
            options.warmup_steps,
            adaptive,
            options.tiny,
            options.workdir,
        )
        started = time.perf_counter()
        result = run_config(
            model,
            dataset,
            options.seq_len,
            per_device,
            accumulation,
            steps,
            adaptive,
            options.tiny,
            options.workdir,
        )
        result["kind"] = kind
        result["round"] = round_
        report["runs"].append(result)
        save(report, path)
        print(
            f"{kind:>5} {per_device}x{accumulation}: {result['tokens_per_second_after_first_step']:,.0f} tokens/s "
            f"(steps {', '.join(f'{s:.2f}' for s in result['step_seconds'])} s) in "
            f"{time.perf_counter() - started:.0f} s",
            flush=True,
        )

    summarise(report)
    save(report, path)
    print_table(report)


def pair_of(run) -> str:
    return f"{run['per_device_train_batch_size']}x{run['gradient_accumulation_steps']}"


def pooled(runs: list[dict], first: int = 1) -> tuple[float, float]:
    """Tokens/s and mean step seconds over the steps from `first` of `runs` (a configuration's rounds) together."""
    seconds = [s for run in runs for s in (run["step_seconds"][first:] or run["step_seconds"])]
    tokens = runs[0]["tokens_per_step"] * len(seconds)
    return tokens / sum(seconds), sum(seconds) / len(seconds)


def summarise(report):
    """Each configuration's rounds pooled; the best plain pair and every ratio over the steps after each run's first
    (the same basis for every arm), AdaptiveBatch's also over all steps and over its steady steps."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for run in report["runs"]:
        groups.setdefault((run["kind"], pair_of(run)), []).append(run)
    plain = {pair: runs for (kind, pair), runs in groups.items() if kind == "plain"}
    speeds = {pair: pooled(runs)[0] for pair, runs in plain.items()}
    best = max(speeds, key=speeds.get)
    best_all_steps = pooled(plain[best], first=0)[0]
    summary = {
        "best_plain": best,
        "best_plain_tokens_per_second": speeds[best],
        "rounds": max(len(runs) for runs in groups.values()),
        "overhead": [],
        "auto": [],
    }
    for (kind, pair), runs in groups.items():
        if kind == "fixed" and pair in plain:
            summary["overhead"].append(
                {"pair": pair, "step_time_ratio": pooled(runs)[1] / pooled(plain[pair])[1]}
            )
        if kind == "auto":
            steady = [r["tokens_per_second_steady"] for r in runs if r["tokens_per_second_steady"]]
            steady_speed = sum(steady) / len(steady) if steady else None
            summary["auto"].append(
                {
                    "pair": pair,
                    "settled_micro_batch_size": runs[0]["controller"]["size"],
                    "settled_micro_batch_sizes": [r["controller"]["size"] for r in runs],
                    # the same basis for both: every step after each run's first
                    "over_best_after_first": pooled(runs)[0] / speeds[best],
                    # the same basis for both: every step, the first too
                    "over_best_all_steps": pooled(runs, first=0)[0] / best_all_steps,
                    # mixed bases, kept for the files written before: AdaptiveBatch's steady steps (mean over its
                    # runs) or every step, over the best pair's steps after the first
                    "steady_over_best": (steady_speed or 0) / speeds[best],
                    "all_steps_over_best": pooled(runs, first=0)[0] / speeds[best],
                }
            )
    report["summary"] = summary


def print_table(report):
    print(f"\n{report['device']}, {report['model']}, seq {report['seq_len']}")
    print(f"{'round':>5} {'run':>6} {'pair':>6} {'micro':>12} {'tokens/s':>10} {'steady':>8} {'peak GiB':>9}")
    for run in report["runs"]:
        micro = sorted({m for m in run["micro_batch_size_per_step"] if m})
        micro_text = "-".join(map(str, micro)) if micro else str(run["per_device_train_batch_size"])
        peak = f"{run['peak_allocated_gib']:.1f}" if run["peak_allocated_gib"] else "-"
        steady = run.get("tokens_per_second_steady")
        print(
            f"{run.get('round', 0):>5} {run['kind']:>6} {pair_of(run):>6} {micro_text:>12} "
            f"{run['tokens_per_second_after_first_step']:>10,.0f} {f'{steady:,.0f}' if steady else '-':>8} {peak:>9}"
        )
    summary = report["summary"]
    print("(tokens/s over the steps after each run's first; steady: AdaptiveBatch's steps after it settled)")
    for item in summary["overhead"]:
        print(f"overhead at {item['pair']}: step time x{item['step_time_ratio']:.3f} of the plain Trainer's")
    for item in summary["auto"]:
        print(
            f"auto from {item['pair']}: settled at {item['settled_micro_batch_sizes']}, "
            f"{item['over_best_after_first']:.1%} of the best pair ({summary['best_plain']}) over the steps after "
            f"each run's first, {item['over_best_all_steps']:.1%} over all steps"
        )


if __name__ == "__main__":
    main()
