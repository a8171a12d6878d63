"""The host's cost of a step against the user's `gradient_accumulation_steps`, at one slicing (issue 52).

Every arm trains the same effective batch (`--effective`, default 128 rows) in micro-batches of the same size
(`--micro`, default the whole step): the plain Trainer at `micro x (effective / micro)`, and `AdaptiveBatch(micro_batch_size
=micro)` from the user's `(effective / a) x a` for each `a` of `--accumulations` (default 1, 8, 64, 128), which the
loop runs as `a` loop batches a step, all but the last empty. So every arm runs the same forwards and backwards; what
differs is the loop's per-batch bookkeeping (FLOP and token counting, the NaN filter, callbacks). Arms run in
interleaved rounds (A B C, C B A, ...), each after a warm-up step of its own; reported: each arm's median step time
over the rounds (first step of each run excluded) and its extra milliseconds over the plain arm, on a tiny Llama of
`--layers` layers (the per-batch bookkeeping that walks the model grows with it). One torch thread.

    python benchmarks/host_cost.py --out $OUT [--layers 1,32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys

import torch
from common import StepClock, save, versions
from rounds import WarmUps, add_arguments, interleaved


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--effective", type=int, default=128)
    parser.add_argument("--micro", type=int, default=None, help="rows a forward (default: the whole step)")
    parser.add_argument("--accumulations", default="1,8,64,128")
    parser.add_argument("--layers", default="1,32")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=16)
    add_arguments(parser)
    options = parser.parse_args()
    options.rounds = max(options.rounds, 1)
    torch.set_num_threads(1)
    micro = options.micro or options.effective
    accumulations = [int(a) for a in options.accumulations.split(",")]

    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Trainer,
        TrainingArguments,
        default_data_collator,
    )

    from adaptive_batch import AdaptiveBatch

    results = {}
    for layers in [int(n) for n in options.layers.split(",")]:
        torch.manual_seed(0)
        config = LlamaConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=64,
            use_cache=False,
        )
        model = LlamaForCausalLM(config)
        ids = torch.randint(
            0, config.vocab_size, (options.effective * options.steps, options.seq_len)
        ).tolist()
        dataset = [{"input_ids": r, "attention_mask": [1] * options.seq_len, "labels": r} for r in ids]

        def step_seconds(model, dataset, arm: str, steps: int) -> list[float]:
            clock = StepClock()
            if arm == "plain":
                per_device, accumulation, callbacks = micro, options.effective // micro, [clock.callback]
            else:
                accumulation = int(arm.split("x")[1])
                per_device = options.effective // accumulation
                callbacks = [clock.callback, AdaptiveBatch(micro_batch_size=micro)]
            args = TrainingArguments(
                output_dir="/tmp/adaptive-batch-host-cost",
                per_device_train_batch_size=per_device,
                gradient_accumulation_steps=accumulation,
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
            return clock.step_seconds

        arms = ["plain", *(f"adaptive {options.effective // a}x{a}" for a in accumulations)]
        warm_ups = WarmUps(options.warmup_steps)
        runs: dict[str, list[float]] = {arm: [] for arm in arms}
        for _, arm in interleaved(arms, options.rounds):
            gc.collect()
            warm_ups.before(arm, step_seconds, model, dataset, arm, options.warmup_steps)
            seconds = step_seconds(model, dataset, arm, options.steps)
            runs[arm].append(statistics.median(seconds[1:]))
            print(f"{layers} layers  {arm:>16}: {runs[arm][-1] * 1000:7.1f} ms a step", flush=True)
        plain = statistics.median(runs["plain"])
        results[f"{layers} layers"] = {
            "median_step_seconds_per_run": runs,
            "median_step_seconds": {arm: statistics.median(values) for arm, values in runs.items()},
            "extra_ms_over_plain": {
                arm: (statistics.median(values) - plain) * 1000
                for arm, values in runs.items()
                if arm != "plain"
            },
            "warmup": warm_ups.record(),
        }

    report = {
        "command": " ".join(sys.argv),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, 1 torch thread",
        "versions": versions("adaptive_batch"),
        "setup": {
            "model": "Llama, hidden 16, the layers below",
            "seq_len": options.seq_len,
            "effective_batch_size": options.effective,
            "micro_batch_size": micro,
            "plain": f"{micro} x {options.effective // micro}",
            "steps": options.steps,
            "rounds": options.rounds,
            "basis": "median over rounds of each run's median step time, first step excluded",
        },
        "results": results,
    }
    os.makedirs(options.out, exist_ok=True)
    save(report, os.path.join(options.out, "host_cost_cpu.json"))
    print(f"\nstep time, ms (extra over plain {micro} x {options.effective // micro})")
    for name, result in results.items():
        cells = "  ".join(
            f"{arm.split()[-1]}: {result['median_step_seconds'][arm] * 1000:.1f} ({extra:+.1f})"
            for arm, extra in result["extra_ms_over_plain"].items()
        )
        print(f"{name:>10}  plain {result['median_step_seconds']['plain'] * 1000:.1f}  {cells}")


if __name__ == "__main__":
    main()
