"""Each engine's undoing of a failed micro-batch, on the device's own torch and DeepSpeed: tests/ddp_worker.py's FSDP2
and ZeRO-2/3 runs (`zero2_offload`: ZeRO-2 with the optimizer offloaded to the CPU, test_deepspeed.py's config), one
process under torchrun, with the fake out-of-memory error in the middle of a backward of a micro-batch of 2 (with
`--oom-after 1`, the second such, the first step's last micro-batch), against the clean run at micro-batch 1. Bit
for bit, as tests/test_ddp.py and test_deepspeed.py assert on the CPU. The tiny model is float32 on the GPU
(ZeRO-3 refuses float64 parameters on any device) and float64 on the CPU, as in the tests but for their ZeRO-3
worker, which runs float32 too.

    python benchmarks/engine_resets.py --out results/ [--cpu] [--kinds zero2,zero3,zero2_offload] [--oom-after 1]
"""

import argparse
import json
import os
import subprocess
import sys

import torch
from common import ROOT, save

WORKER = os.path.join(ROOT, "tests", "ddp_worker.py")


OFFLOAD = {
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "zero_force_ds_cpu_optimizer": False,
}


def run(
    out: str, kind: str, micro: int, fake_oom_rank: str | None, cpu: bool, dtype: str, oom_after: int = 0
) -> dict:
    os.makedirs(out, exist_ok=True)
    config = OFFLOAD if kind == "zero2_offload" else {}
    kind = "zero2" if kind == "zero2_offload" else kind
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--standalone", WORKER]
    command += [out, kind, str(micro), *([fake_oom_rank] if fake_oom_rank else [])]
    env = {
        **os.environ,
        "WORKER_ARGS": json.dumps({"use_cpu": cpu}),
        "WORKER_DTYPE": dtype,
        "WORKER_DEEPSPEED": json.dumps(config),
        "WORKER_OOM_AFTER": str(oom_after),
        "OMP_NUM_THREADS": "1",
    }
    process = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    if process.returncode != 0:
        worker = [line for line in process.stderr.splitlines() if line.startswith("[rank0]:")]
        return {"returncode": process.returncode, "stderr": "\n".join(worker[-60:]) or process.stderr[-3000:]}
    with open(os.path.join(out, "rank0.json")) as f:
        return {"returncode": 0, **json.load(f)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--kinds", default="fsdp2,zero2,zero3")
    parser.add_argument("--oom-after", type=int, default=0, help="oversized micro-batches that pass first")
    parser.add_argument(
        "--dtype", help="the model's dtype: float64 on the CPU, float32 on a GPU unless given"
    )
    options = parser.parse_args()
    dtype = options.dtype or ("float64" if options.cpu else "float32")
    report = {
        "command": " ".join(sys.argv),
        "device": "cpu" if options.cpu else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "dtype": dtype,
        "oom_after": options.oom_after,
        "kinds": {},
    }
    for kind in options.kinds.split(","):
        base = os.path.join(options.out, "engine_resets", kind)
        retried = run(os.path.join(base, "oom"), kind, 2, "0", options.cpu, dtype, options.oom_after)
        clean = run(os.path.join(base, "clean"), kind, 1, None, options.cpu, dtype)
        entry = {"retried_returncode": retried["returncode"], "clean_returncode": clean["returncode"]}
        if retried["returncode"] == 0 and clean["returncode"] == 0:
            a = torch.load(os.path.join(base, "oom", "rank0.pt"))
            b = torch.load(os.path.join(base, "clean", "rank0.pt"))
            entry.update(
                raised=retried["raised"],
                micro_batch_sizes=sorted({log["adaptive_batch/micro_batch_size"] for log in retried["logs"]}),
                losses_equal=[log["loss"] for log in retried["logs"]]
                == [log["loss"] for log in clean["logs"]],
                weights_equal=all(torch.equal(a[name], b[name]) for name in a),
                steps=len(retried["logs"]),
            )
        else:
            entry["stderr"] = retried.get("stderr") or clean.get("stderr")
        report["kinds"][kind] = entry
        save(report, os.path.join(options.out, "engine_resets.json"))
    for kind, entry in report["kinds"].items():
        print(kind, {k: v for k, v in entry.items() if k != "stderr"})


if __name__ == "__main__":
    main()
