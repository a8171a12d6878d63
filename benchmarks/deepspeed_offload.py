"""DeepSpeed ZeRO-2 with the optimizer offloaded to the CPU, on one GPU: AdaptiveBatch against the plain DeepSpeed
Trainer at the same micro-batch, then a real CUDA out-of-memory error survived.

A 1.1B Llama (TinyLlama's shape, random weights, bf16) fully fine-tuned, sequences of `--seq-len` tokens, the same
rows in the same order in every arm (`train_sampling_strategy="sequential"`). Arms in one process, each a fresh
model and engine (the last one's given back first: `accelerator.free_memory()`), in rounds of plain, adaptive,
adaptive, plain (so that a drift over the call weighs on both alike: one such round is two order-reversed rounds of
the two arms); before its first timed run each kind trains `--warmup-steps` (default 1) unrecorded steps on an
engine of its own (see rounds.py):

- plain: `per_device_train_batch_size=M`, `gradient_accumulation_steps=K`, DeepSpeed's own accumulation;
- adaptive: the same arguments and `AdaptiveBatch(micro_batch_size=M)`: K micro-batches of M a step, the
  last marked as the accumulation boundary by AdaptiveBatch, as DeepSpeed's own accumulation marks it.

Reported: every step's seconds and the host CPU seconds of all its threads, tokens/s from the median step after
the first, the ratio of the adaptive arms' mean to the plain arms' mean, the spread between identical arms (the noise
floor the ratio must be read against), each arm's seconds to load (model and Trainer) and to train (DeepSpeed's
engine is built inside) and its peak memory, and the largest relative difference of the parameters after the run
between the two arms (the same samples, the same micro-batches). First (unless `--memory-fraction 0`), with the
process capped by `torch.cuda.set_per_process_memory_fraction` (then the cap is lifted), AdaptiveBatch from a
per-device batch of M x K (one micro-batch a step) must run out of memory for real and finish by retrying smaller.

The optimizer is DeepSpeed's AdamW run by torch on the CPU (`torch_adam: true`, so nothing is compiled); the ZeRO-2
offload config is examples/launch/zero2_offload.json's otherwise.

    python benchmarks/deepspeed_offload.py --out results/            # on the GPU
    python benchmarks/deepspeed_offload.py --out results/ --memory-fraction 0 --steps 14 --rounds 2  # A/B only
    python benchmarks/deepspeed_offload.py --out results/ --memory-fraction 0 --no-offload  # A/B, optimizer on GPU
    python benchmarks/deepspeed_offload.py --tiny --out /tmp/ds      # the same code on the CPU, a tiny model
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch
from base_model import TINY, save_random_llama
from common import device_name, save, sync, versions
from rounds import WARMUP_STEPS, WarmUps

TINYLLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=4096,
)
CONFIG = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples/launch/zero2_offload.json"
)


def deepspeed_config(offload: bool = True) -> dict:
    with open(CONFIG) as f:
        config = json.load(f)
    config["optimizer"]["params"]["torch_adam"] = True
    if not offload:  # ZeRO-2 with the optimizer on the GPU: a step without the CPU optimizer's noise
        del config["zero_optimization"]["offload_optimizer"]
    config["steps_per_print"] = 10**6
    return config


class StepTimer:
    """Seconds of every optimizer step, the device synchronised at both ends, and the host CPU seconds this process
    spent in it (all threads: Python, the launches, DeepSpeed's and torch's CPU work)."""

    def __init__(self):
        from transformers import TrainerCallback

        timer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                sync()
                timer.started = time.perf_counter()
                timer.cpu_started = time.process_time()

            def on_step_end(self, args, state, control, **kwargs):
                sync()
                timer.seconds.append(time.perf_counter() - timer.started)
                timer.cpu_seconds.append(time.process_time() - timer.cpu_started)

        self.callback = Callback()
        self.seconds: list[float] = []
        self.cpu_seconds: list[float] = []
        self.started = self.cpu_started = 0.0


def run_arm(
    name, model_path, rows, micro, accumulation, steps, adaptive, tiny, workdir, per_device=None, offload=True
):
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator

    from adaptive_batch import AdaptiveBatch

    started = time.perf_counter()
    AcceleratorState._reset_state(reset_partial_state=False)  # a fresh engine config for every arm
    dtype = torch.float32 if tiny else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    timer = StepTimer()
    callbacks = [timer.callback]
    plugin = AdaptiveBatch(micro_batch_size=micro) if adaptive else None
    if plugin is not None:
        callbacks.append(plugin)
    args = TrainingArguments(
        output_dir=os.path.join(workdir, name),
        per_device_train_batch_size=per_device or micro,
        gradient_accumulation_steps=accumulation if per_device is None else 1,
        max_steps=steps,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        bf16=not tiny,
        deepspeed=deepspeed_config(offload),
        train_sampling_strategy="sequential",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=rows, data_collator=default_data_collator, callbacks=callbacks
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    load_seconds = time.perf_counter() - started
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    seq_len = len(rows[0]["input_ids"])
    samples = (per_device or micro * accumulation) * steps
    median = statistics.median(timer.seconds[1:] or timer.seconds)
    result = {
        "name": name,
        "adaptive": adaptive,
        "step_seconds": timer.seconds,
        "step_cpu_seconds": timer.cpu_seconds,
        "tokens_per_second": (per_device or micro * accumulation) * seq_len / median,
        "load_seconds": load_seconds,
        "train_seconds": time.perf_counter() - started - load_seconds,
        "samples": samples,
        "losses": [log["loss"] for log in logs],
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30
        if torch.cuda.is_available()
        else None,
        "micro_batch_sizes": [log.get("adaptive_batch/micro_batch_size") for log in logs],
        "samples_seen": [log.get("adaptive_batch/samples_seen") for log in logs],
    }
    params = {n: p.detach().float().cpu() for n, p in trainer.model.named_parameters()}
    trainer.accelerator.free_memory()  # DeepSpeed's engine destroyed, accelerate's references dropped
    del trainer, model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result, params


def largest_difference(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-30)) for n in a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: a dry run")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of 4 arms: plain, adaptive, adaptive, plain (the order of the two reversed within each)",
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=WARMUP_STEPS,
        help="before each kind's first timed arm, steps of the same kind on an engine of its own, unrecorded",
    )
    parser.add_argument("--memory-fraction", type=float, default=0.15)
    parser.add_argument("--workdir", default="/tmp/adaptive-batch-deepspeed")
    parser.add_argument(
        "--no-offload", action="store_true", help="the A/B arms with the optimizer on the GPU (ZeRO-2 alone)"
    )
    options = parser.parse_args()
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(key, value)  # one process without a launcher (DeepSpeed wants a process group)
    os.environ.setdefault("MASTER_PORT", "29517")
    if options.tiny:
        from adaptive_batch.testing import skip_deepspeed_shm_build

        skip_deepspeed_shm_build()
    os.makedirs(options.out, exist_ok=True)
    seq_len = 32 if options.tiny else options.seq_len
    model_path = save_random_llama(
        os.path.join(options.workdir, "model"),
        TINY if options.tiny else TINYLLAMA_1B,
        on_gpu=not options.tiny,
    )
    vocab = (TINY if options.tiny else TINYLLAMA_1B)["vocab_size"]
    generator = torch.Generator().manual_seed(0)
    batch = options.micro * options.accumulation
    rows = []
    for _ in range(batch * options.steps):
        ids = torch.randint(0, vocab, (seq_len,), generator=generator).tolist()
        rows.append({"input_ids": ids, "labels": ids, "attention_mask": [1] * seq_len})

    report = {
        "command": " ".join(sys.argv),
        "device": device_name(),
        "versions": versions("deepspeed"),
        "shape": "tiny" if options.tiny else "TinyLlama-1.1B",
        "seq_len": seq_len,
        "micro": options.micro,
        "accumulation": options.accumulation,
        "optimizer_offloaded": not options.no_offload,
        "arms": [],
    }
    if options.memory_fraction > 0:
        # first, a real out-of-memory error: one micro-batch of the whole step, in a process capped below its need
        if torch.cuda.is_available():
            torch.cuda.set_per_process_memory_fraction(options.memory_fraction)
        try:
            result, _ = run_arm(
                "oom", model_path, rows, batch, 1, 2, True, options.tiny, options.workdir, per_device=batch
            )
            report["out_of_memory"] = {"finished": True, "memory_fraction": options.memory_fraction, **result}
        except Exception as error:  # noqa: BLE001 - recorded: the run must show what happened
            report["out_of_memory"] = {"finished": False, "error": f"{type(error).__name__}: {error}"[:2000]}
        if torch.cuda.is_available():
            torch.cuda.set_per_process_memory_fraction(1.0)
        write(report, options.out)

    params = {}
    warm_ups = WarmUps(options.warmup_steps)
    report["warmup"] = warm_ups.record()
    for _ in range(options.rounds):
        for adaptive in (False, True, True, False):
            kind = "adaptive" if adaptive else "plain"
            warm_ups.before(
                kind,
                run_arm,
                f"{kind}_warmup",
                model_path,
                rows,
                options.micro,
                options.accumulation,
                options.warmup_steps,
                adaptive,
                options.tiny,
                options.workdir,
                offload=not options.no_offload,
            )
            name = f"{kind}{len(report['arms'])}"
            result, weights = run_arm(
                name,
                model_path,
                rows,
                options.micro,
                options.accumulation,
                options.steps,
                adaptive,
                options.tiny,
                options.workdir,
                offload=not options.no_offload,
            )
            report["arms"].append(result)
            params.setdefault(adaptive, weights)
            report["summary"] = summarise(report["arms"], params)
            write(report, options.out)
    write(report, options.out)
    print_table(report)


def summarise(arms: list[dict], params: dict) -> dict:
    """Tokens/s of each arm, the adaptive arms' mean over the plain ones' (so far), the largest relative difference
    between two arms of one kind (the noise floor); the parameters of the first of each after the run (the same
    samples and micro-batches)."""
    plain = [a["tokens_per_second"] for a in arms if not a["adaptive"]]
    adaptive = [a["tokens_per_second"] for a in arms if a["adaptive"]]
    summary = {"plain_tokens_per_second": plain, "adaptive_tokens_per_second": adaptive}
    spreads = [max(kind) / min(kind) - 1 for kind in (plain, adaptive) if len(kind) > 1]
    if spreads:
        summary["spread_between_identical_arms"] = max(spreads)
    if plain and adaptive:
        summary["adaptive_over_plain"] = sum(adaptive) / len(adaptive) / (sum(plain) / len(plain))
        # the same from every step after each arm's first, pooled per kind: the median step time's ratio
        pooled = {
            kind: statistics.median(t for a in arms if a["adaptive"] == kind for t in a["step_seconds"][1:])
            for kind in (False, True)
        }
        summary["adaptive_over_plain_pooled_median"] = pooled[False] / pooled[True]
        summary["largest_parameter_difference"] = largest_difference(params[True], params[False])
        summary["losses"] = {"plain": arms[0]["losses"], "adaptive": arms[1]["losses"]}
    return summary


def write(report: dict, out: str) -> None:
    save(report, os.path.join(out, "deepspeed_offload.json"))


def print_table(report: dict) -> None:
    print(f"\n{'arm':12} {'load s':>8} {'train s':>8} {'tokens/s':>9} {'peak GiB':>9}")
    for arm in report["arms"]:
        peak = arm["peak_allocated_gib"]
        print(
            f"{arm['name']:12} {arm['load_seconds']:>8.1f} {arm['train_seconds']:>8.1f} "
            f"{arm['tokens_per_second']:>9.0f} {'-' if peak is None else f'{peak:.1f}':>9}"
        )
    summary = report.get("summary", {})
    if "adaptive_over_plain" in summary:
        print(
            f"adaptive / plain tokens/s: {summary['adaptive_over_plain']:.4f}, pooled steps' median "
            f"{summary['adaptive_over_plain_pooled_median']:.4f} (identical arms apart by "
            f"{summary.get('spread_between_identical_arms', float('nan')):.4f}); largest parameter difference "
            f"{summary['largest_parameter_difference']:.2e}"
        )
    if "out_of_memory" not in report:
        return
    oom = report["out_of_memory"]
    sizes = oom.get("micro_batch_sizes")
    print(f"out of memory: finished={oom['finished']} micro-batches {sizes} {oom.get('error', '')}")


if __name__ == "__main__":
    main()
