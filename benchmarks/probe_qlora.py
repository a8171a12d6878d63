"""`adaptive-batch probe` on a QLoRA Llama-2-7B shape: the boundary, the trials, and how long the probe took.

The base model is created with random weights in bf16 and saved (speed and memory do not depend on the values);
then the probe loads it as a QLoRA run would (NF4, double quantisation, bf16 compute, LoRA r=16 on q/v,
gradient checkpointing, paged_adamw_8bit). Writes OUT/probe_qlora_<seq_len>.json and prints the probe's table.

    python3 benchmarks/probe_qlora.py --out $OUT --seq-len 1024
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from base_model import save_random_llama  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--workdir", default="/tmp/adaptive-batch-probe")
    options = parser.parse_args()

    from adaptive_batch.cli import main as cli

    path = save_random_llama(os.path.join(options.workdir, "llama-2-7b-shape"))

    argv = [
        "probe",
        path,
        "--seq-len",
        str(options.seq_len),
        "--load-in-4bit",
        "--lora-r",
        "16",
        "--lora-alpha",
        "32",
        "--lora-target",
        "q_proj,v_proj",
        "--optim",
        "paged_adamw_8bit",
        "--effective-batch",
        "64",
        "--no-cache",
        "--json",
    ]
    started = time.perf_counter()
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = cli(argv)
    wall = time.perf_counter() - started
    result = json.loads(stdout.getvalue())
    result["command"] = "adaptive-batch " + " ".join(argv)
    result["wall_seconds_including_model_load"] = wall
    os.makedirs(options.out, exist_ok=True)
    with open(os.path.join(options.out, f"probe_qlora_{options.seq_len}.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"exit {code}; probe {result['seconds']:.0f} s (with loading {wall:.0f} s)")
    for trial in result["trials"]:
        speed = f"{trial['tokens_per_second']:,.0f}" if trial["tokens_per_second"] else "-"
        peak = f"{trial['peak_bytes'] / 2**30:.1f}" if trial["peak_bytes"] else "-"
        print(
            f"{trial['size']:>5} oom={trial['out_of_memory']!s:<5} reserved {peak:>6} GiB  {speed:>8} tok/s"
        )
    print(
        f"boundary {result['boundary']} (first failing {result['first_failing']}, predicted {result['predicted']}),"
        f" recommended {result['recommended']}, for 64: {result['per_device_train_batch_size']} x "
        f"{result['gradient_accumulation_steps']}"
    )


if __name__ == "__main__":
    main()
