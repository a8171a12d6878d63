"""The cost of measuring the gradient noise scale: `AdaptiveBatch(measure_noise=True)` against `measure_noise=False`,
interleaved in one process on one model.

The setup is qlora_throughput.py's (Llama-2-7B shape, NF4 QLoRA, LoRA r=16 on q/v, gradient checkpointing, paged
8-bit AdamW), fixed-length rows, the user's 8 x 8 with a fixed micro-batch of 8, so every step has 8 micro-batches
and measures. Runs alternate on and off, and which one goes first alternates too (on, off, off, on, ...), so that
drift in the machine's speed falls on both; before its first timed run each of the two trains `--warmup-steps`
(default 1) unrecorded steps of its own (see rounds.py). Per run: the mean step time over the steps after the
first. Reported:
the median over pairs of (on / off) and the ratio of the medians; the logged noise scale of the "on" runs shows
that measuring happened.

    python benchmarks/noise_overhead.py --out OUT                 # the H200 run (needs CUDA and bitsandbytes)
    python benchmarks/noise_overhead.py --out OUT --tiny          # a CPU dry run of the same code on a tiny model
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics

import torch
from base_model import header, qlora_trainer
from common import StepClock, build_model, save
from rounds import WARMUP_STEPS, WarmUps


def run(model, dataset, measure: bool, steps: int, tiny: bool, workdir: str) -> dict:
    from adaptive_batch import AdaptiveBatch

    clock = StepClock()
    callbacks = [clock.callback, AdaptiveBatch(micro_batch_size=8, measure_noise=measure)]
    trainer = qlora_trainer(model, dataset, callbacks, os.path.join(workdir, "trainer"), 8, 8, steps, tiny)
    trainer.train()
    seconds = clock.step_seconds
    logs = [log for log in trainer.state.log_history if "loss" in log]
    result = {
        "measure_noise": measure,
        "step_seconds": seconds,
        "mean_step_seconds_after_first": statistics.fmean(seconds[1:] or seconds),  # (a 1-step warm-up)
        "accumulation_steps_per_step": [log.get("adaptive_batch/accumulation_steps") for log in logs],
        "noise_scale_per_step": [log.get("adaptive_batch/noise_scale") for log in logs],
    }
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="a CPU dry run on a tiny model")
    parser.add_argument("--pairs", type=int, default=4, help="on/off pairs")
    parser.add_argument(
        "--steps", type=int, default=6, help="optimizer steps per run (the first is excluded)"
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=WARMUP_STEPS,
        help="before each arm's first timed run, steps of the same arm, unrecorded (0: none)",
    )
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--workdir", default="/tmp/adaptive-batch-bench")
    options = parser.parse_args()
    os.makedirs(options.out, exist_ok=True)
    os.makedirs(options.workdir, exist_ok=True)

    model, config = build_model(options.tiny, options.workdir)
    generator = torch.Generator().manual_seed(0)
    rows = 64 * options.steps
    ids = torch.randint(0, config.vocab_size, (rows, options.seq_len), generator=generator)
    dataset = [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row} for row in ids]
    report = {
        **header(options.tiny),
        "seq_len": options.seq_len,
        "pair": "8 x 8, micro_batch_size=8",
        "runs": [],
    }
    warm_ups = WarmUps(options.warmup_steps)
    report["warmup"] = warm_ups.record()
    path = os.path.join(options.out, "noise_overhead.json")
    for pair in range(options.pairs):
        order = (True, False) if pair % 2 == 0 else (False, True)
        for measure in order:
            warm_ups.before(
                f"measure_noise={measure}",
                run,
                model,
                dataset,
                measure,
                options.warmup_steps,
                options.tiny,
                options.workdir,
            )
            result = run(model, dataset, measure, options.steps, options.tiny, options.workdir)
            result["pair"] = pair
            report["runs"].append(result)
            save(report, path)
            print(
                f"pair {pair} measure_noise={measure!s:5}: {result['mean_step_seconds_after_first']:.3f} s/step, "
                f"noise scale {result['noise_scale_per_step'][-1]}",
                flush=True,
            )
    summarise(report)
    save(report, path)
    print(json.dumps(report["summary"], indent=1))


def summarise(report: dict) -> None:
    mean = {}
    for result in report["runs"]:
        mean[(result["pair"], result["measure_noise"])] = result["mean_step_seconds_after_first"]
    pairs = sorted({pair for pair, _ in mean})
    ratios = [mean[(pair, True)] / mean[(pair, False)] for pair in pairs if (pair, False) in mean]
    on = [mean[(pair, True)] for pair in pairs if (pair, True) in mean]
    off = [mean[(pair, False)] for pair in pairs if (pair, False) in mean]
    report["summary"] = {
        "paired_ratios_on_over_off": ratios,
        "median_paired_ratio": statistics.median(ratios),
        "ratio_of_medians": statistics.median(on) / statistics.median(off),
        "median_step_seconds_on": statistics.median(on),
        "median_step_seconds_off": statistics.median(off),
    }


if __name__ == "__main__":
    main()
