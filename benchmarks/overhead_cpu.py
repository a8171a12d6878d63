"""CPU overhead: step time of the plain Trainer against `AdaptiveBatch(micro_batch_size=<per-device size>)`.

Same model, data, per-device size and accumulation; the only difference is the callback, so the step is cut into
the same micro-batches either way. Runs alternate, and which of the two goes first alternates too, so that drift
in the machine's speed falls on both; before its first timed run each of the two trains `--warmup-steps`
(default 1) unrecorded steps of its own (see rounds.py). Reported: the ratio of the medians and of the minimums over repetitions of
each run's mean step time (first step excluded), and, measured directly, the time AdaptiveBatch's own code takes
per step (the step minus the user's `training_step` calls) as a share of the step. One torch thread: on a small
shared machine, thread scheduling is the largest source of noise.

    python benchmarks/overhead_cpu.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time

import torch
from common import save, versions
from rounds import WARMUP_STEPS, WarmUps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--per-device", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=WARMUP_STEPS,
        help="before each arm's first timed run, steps of the same arm, unrecorded (0: none)",
    )
    options = parser.parse_args()
    torch.set_num_threads(options.threads)

    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        default_data_collator,
    )

    from adaptive_batch import AdaptiveBatch
    from adaptive_batch.runtime.step import MicroBatchRunner

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=1024,
        use_cache=False,
    )
    model = LlamaForCausalLM(config)
    effective = options.per_device * options.accumulation
    ids = torch.randint(0, config.vocab_size, (effective * options.steps, options.seq_len)).tolist()
    dataset = [{"input_ids": r, "attention_mask": [1] * options.seq_len, "labels": r} for r in ids]

    own_seconds: list[float] = []  # per step: AdaptiveBatch's time outside the user's training_step
    original_run = MicroBatchRunner.run

    def timed_run(self, inner_step, *args, **kwargs):
        inner = [0.0]

        def timed_inner(*a, **k):
            started = time.perf_counter()
            try:
                return inner_step(*a, **k)
            finally:
                inner[0] += time.perf_counter() - started

        started = time.perf_counter()
        loss = original_run(self, timed_inner, *args, **kwargs)
        own_seconds.append(time.perf_counter() - started - inner[0])
        return loss

    MicroBatchRunner.run = timed_run

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.marks = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append(time.perf_counter())

    def mean_step_seconds(with_plugin: bool, steps: int = options.steps) -> float:
        clock = Clock()
        callbacks = [clock] + ([AdaptiveBatch(micro_batch_size=options.per_device)] if with_plugin else [])
        args = TrainingArguments(
            output_dir="/tmp/adaptive-batch-overhead",
            per_device_train_batch_size=options.per_device,
            gradient_accumulation_steps=options.accumulation,
            max_steps=steps,
            lr_scheduler_type="constant",
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            use_cpu=True,
            logging_steps=10**6,
            seed=0,
        )
        Trainer(
            model=model,
            args=args,
            train_dataset=dataset,
            data_collator=default_data_collator,
            callbacks=callbacks,
        ).train()
        seconds = [b - a for a, b in zip(clock.marks, clock.marks[1:])]
        timed = seconds[1:] or seconds  # (all of a 1-step warm-up)
        return sum(timed) / len(timed)

    warm_ups = WarmUps(options.warmup_steps)  # allocator, thread pools, each arm's own code paths
    plain, plugin = [], []
    for repeat in range(options.repeats):
        for with_plugin in (False, True) if repeat % 2 == 0 else (True, False):
            gc.collect()
            measured = len(own_seconds)
            warm_ups.before(
                "plugin" if with_plugin else "plain", mean_step_seconds, with_plugin, options.warmup_steps
            )
            del own_seconds[measured:]  # a warm-up's steps are not measured
            (plugin if with_plugin else plain).append(mean_step_seconds(with_plugin))
        print(f"plain {plain[-1] * 1000:.1f} ms   plugin {plugin[-1] * 1000:.1f} ms", flush=True)

    report = {
        "command": " ".join(sys.argv),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "versions": versions("adaptive_batch"),
        "setup": {
            "model": "Llama 4x128",
            "seq_len": options.seq_len,
            "per_device_train_batch_size": options.per_device,
            "gradient_accumulation_steps": options.accumulation,
            "steps": options.steps,
        },
        "warmup": warm_ups.record(),
        "plain_mean_step_seconds": plain,
        "plugin_mean_step_seconds": plugin,
        "median_ratio": statistics.median(plugin) / statistics.median(plain),
        "min_ratio": min(plugin) / min(plain),
        "pairwise_ratios": [b / a for a, b in zip(plain, plugin)],
        "median_pairwise_ratio": statistics.median(b / a for a, b in zip(plain, plugin)),
        "own_code_seconds_per_step_median": statistics.median(own_seconds),
        "own_code_share_of_step": statistics.median(own_seconds) / statistics.median(plugin),
    }
    os.makedirs(options.out, exist_ok=True)
    save(report, os.path.join(options.out, "overhead_cpu.json"))
    print(
        f"\nmedian step: plain {statistics.median(plain) * 1000:.1f} ms, plugin {statistics.median(plugin) * 1000:.1f}"
        f" ms; ratio of medians {report['median_ratio']:.4f}, of minimums {report['min_ratio']:.4f}, median of "
        f"pairs {statistics.median(report['pairwise_ratios']):.4f}; AdaptiveBatch's own code "
        f"{report['own_code_seconds_per_step_median'] * 1000:.2f} ms a step ({report['own_code_share_of_step']:.2%})"
    )


if __name__ == "__main__":
    main()
