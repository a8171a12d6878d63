"""Issue 3's benchmark: `adaptive-batch probe` against the true boundary, against `auto_find_batch_size`, and in
training, on a QLoRA Llama-2-7B shape (NF4, double quantisation, bf16 compute, LoRA r=16 on q/v, gradient
checkpointing, paged_adamw_8bit) at one sequence length.

Four phases, each in its own process (so that one phase's cached memory cannot shape the next one's readings). Where
both probe and auto_find are asked for, an unrecorded `warm` process (the model loaded, one short step) runs first,
so that neither is the machine's first GPU process with cold caches, and the two run in `--rounds` order-reversed
rounds (probe, auto_find, auto_find, probe; a later round's runs in the phase's `repeats`); the time ratio is pooled
over the rounds:

1. probe: `adaptive-batch probe MODEL ... --no-eval --json` (the training batch alone, as auto_find_batch_size
   finds it), timed with and without loading the model;
2. auto_find: the plain Trainer with `auto_find_batch_size=True` from `--auto-find-start` samples per device (512 x
   1024 / seq_len by default: the same tokens at every length), until its first good step; the time it loses is
   from its first step's start to the start of the step that succeeded (failed tries and restarts);
3. exhaustive: every size from 95% to 108% of the probe's boundary, each a trial exactly as the probe runs it (a
   real forward, backward and optimizer step under the same limit): the true boundary is the largest size of
   that window below which every size fits;
4. train: the plain Trainer for `--steps` steps at the probe's sizes (`--train-sizes`: the recommended size
   and the boundary by default; accumulation 1): the time of each step, its peak reserved and allocated memory,
   and whether any step ran out of memory. A run at the same size and step count in the earlier JSON is kept. The
   sizes run in `--rounds` rounds (default 2), every other one in reverse order (a later round's runs in their
   size's `repeats`), and each size trains `--warmup-steps` (default 1) unrecorded steps of its own before its
   first timed run (see rounds.py).

Writes OUT/probe_boundary_<seq_len>.json after every phase, and during the train phase after every step (so a run
stopped by a time limit keeps the steps it did, marked `"partial": true`), and prints a table at the end:

    python3 benchmarks/probe_boundary.py --out $OUT --seq-len 1024 --steps 10     # on the H200
    python3 benchmarks/probe_boundary.py --out $OUT --seq-len 4096 --steps 60 --train-sizes boundary \
        --phases probe,train --rounds 1                                            # 60 steps at the boundary
    python benchmarks/probe_boundary.py --out /tmp/out --seq-len 64 --steps 2 --tiny  # a CPU dry run
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rounds import WarmUps, add_arguments, interleaved  # noqa: E402

TINY_BUDGET_GIB = 0.05
LORA = {"r": 16, "alpha": 32, "targets": ["q_proj", "v_proj"]}
HEADROOM = 0.05


def probe_argv(options, model_dir: str) -> list[str]:
    argv = [
        "probe",
        model_dir,
        "--seq-len",
        str(options.seq_len),
        "--load-in-4bit",
        "--lora-r",
        str(LORA["r"]),
    ]
    argv += ["--lora-alpha", str(LORA["alpha"]), "--lora-target", ",".join(LORA["targets"])]
    # the training search alone, the job auto_find_batch_size does (it finds no eval batch)
    argv += ["--headroom", str(HEADROOM), "--effective-batch", "64", "--no-cache", "--no-eval", "--json"]
    if options.tiny:
        argv += [
            "--cpu",
            "--memory-budget",
            str(TINY_BUDGET_GIB),
            "--dtype",
            "fp32",
            "--optim",
            "adamw_torch",
        ]
    else:
        argv += ["--optim", "paged_adamw_8bit"]
    return argv


def device_and_dtype(options):
    import torch

    if options.tiny:
        return torch.device("cpu"), torch.float32
    return torch.device("cuda", 0), torch.bfloat16


def out_path(options) -> str:
    return os.path.join(options.out, f"probe_boundary_{options.seq_len}.json")


def write_report(options, report: dict) -> None:
    """Write the JSON whole, then move it into place: a process stopped mid-write leaves the previous one."""
    path = out_path(options)
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def load(options, model_dir: str):
    from adaptive_batch.probe.load import load_model

    device, dtype = device_and_dtype(options)
    model = load_model(
        model_dir, dtype, True, LORA["r"], LORA["alpha"], LORA["targets"], True, options.seq_len, device
    )
    return model, device, dtype


def limit_bytes(device) -> float:
    from adaptive_batch.runtime.memory import memory_limit

    return memory_limit(device, HEADROOM) if device.type == "cuda" else TINY_BUDGET_GIB * 2**30


def memory_now(device) -> dict:
    import torch

    if device.type != "cuda":
        return {}
    return {
        "peak_reserved_bytes": float(torch.cuda.max_memory_reserved(device)),
        "peak_allocated_bytes": float(torch.cuda.max_memory_allocated(device)),
    }


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- phases (each runs in its own process) -----------------------------------------------------------------------


def phase_probe(options, model_dir: str, _inputs: dict) -> dict:
    from adaptive_batch.cli.main import main as cli

    argv = probe_argv(options, model_dir)
    started = time.perf_counter()
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = cli(argv)
    wall = time.perf_counter() - started
    if code != 0:
        raise RuntimeError(f"adaptive-batch probe exited {code}")
    result = json.loads(stdout.getvalue())
    result["command"] = "adaptive-batch " + " ".join(argv)
    result["wall_seconds_including_model_load"] = wall
    return result


def random_dataset(seq_len: int, rows: int, vocab_size: int):
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (rows, seq_len), generator=generator)

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return rows

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i], "attention_mask": torch.ones_like(ids[i])}

    return Rows()


def trainer_for(options, model, per_device: int, steps: int, dataset, callbacks, **extra):
    from base_model import qlora_trainer

    output_dir = os.path.join(options.workdir, "trainer")
    return qlora_trainer(model, dataset, callbacks, output_dir, per_device, 1, steps, options.tiny, **extra)


class Marks:
    """Times of the Trainer's events, the device synchronised at each, with the batch size the Trainer ran;
    `on_step_end(marks)` is called after each step's mark (outside the step's time)."""

    def __init__(self, device, on_step_end=None):
        import torch
        from transformers import TrainerCallback

        marks = self
        self.events: list[dict] = []
        self.trainer = None

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                synchronize(device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                marks.add("step_begin")

            def on_step_end(self, args, state, control, **kwargs):
                synchronize(device)
                marks.add("step_end", **memory_now(device))
                if on_step_end is not None:
                    on_step_end(marks)

        self.callback = Callback()

    def add(self, event: str, **extra) -> None:
        size = getattr(self.trainer, "_train_batch_size", None)
        self.events.append({"event": event, "time": time.perf_counter(), "batch_size": size, **extra})


def phase_auto_find(options, model_dir: str, _inputs: dict) -> dict:
    model, device, _ = load(options, model_dir)
    start = options.auto_find_start or max(1, 512 * 1024 // options.seq_len)
    marks = Marks(device)
    dataset = random_dataset(options.seq_len, start, model.config.vocab_size)
    trainer = trainer_for(options, model, start, 1, dataset, [marks.callback], auto_find_batch_size=True)
    marks.trainer = trainer
    called = time.perf_counter()
    trainer.train()
    events = marks.events
    end = next(i for i, e in enumerate(events) if e["event"] == "step_end")
    good = max(i for i in range(end) if events[i]["event"] == "step_begin")
    begins = [e for e in events[:end] if e["event"] == "step_begin"]
    return {
        "start": start,
        "sizes_tried": [e["batch_size"] for e in begins],
        "settled_at": events[good]["batch_size"],
        "lost_seconds": events[good]["time"] - begins[0]["time"],
        "seconds_to_first_step_start": begins[0]["time"] - called,
        "good_step_seconds": events[end]["time"] - events[good]["time"],
        "good_step_memory": {k: v for k, v in events[end].items() if k.startswith("peak")},
        "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
    }


def phase_exhaustive(options, model_dir: str, inputs: dict) -> dict:
    from adaptive_batch.probe.trials import TrialRunner, make_optimizer

    boundary = inputs["probe"]["boundary"]
    low, high = max(1, math.floor(0.95 * boundary)), math.ceil(1.08 * boundary)
    model, device, dtype = load(options, model_dir)
    limit = limit_bytes(device)
    optimizer = make_optimizer(model, "adamw_torch" if options.tiny else "paged_adamw_8bit", 2e-4)
    autocast = None if options.tiny else dtype  # bf16 autocast on the GPU, as the probe's CLI does
    runner = TrialRunner(model, optimizer, options.seq_len, model.config.vocab_size, device, autocast, limit)
    started = time.perf_counter()
    runner.warm_up()  # as the probe does
    trials = [runner.run(size) for size in range(low, high + 1)]
    fits = {t.size: t.fits(limit) for t in trials}
    true = max((s for s in fits if all(fits[r] for r in range(low, s + 1))), default=None)
    return {
        "window": [low, high],
        "limit_bytes": limit,
        "trials": [{**t.to_dict(), "fits": fits[t.size]} for t in trials],
        "true_boundary": true,
        "monotone": all(not fits[s] for s in fits if true is not None and s > true),
        "seconds": time.perf_counter() - started,
    }


def phase_train(options, model_dir: str, inputs: dict) -> dict:
    from adaptive_batch.runtime.memory import release_memory

    probe = inputs["probe"]
    model, device, _ = load(options, model_dir)
    limit = limit_bytes(device)
    earlier = inputs.get("train", {})
    runs = {  # earlier runs at the probe's sizes stay in the report (those from before per-run step counts too)
        name: {"steps": earlier.get("steps"), **run}
        for name, run in earlier.get("runs", {}).items()
        if run["size"] == probe.get(name)
    }

    warm_ups = WarmUps(options.warmup_steps)

    def result(partial: bool) -> dict:
        return {
            "limit_bytes": limit,
            "steps": options.steps,
            "rounds": options.rounds,
            "warmup": warm_ups.record(),
            "runs": runs,
            "partial": partial,
        }

    def store(name: str, round_: int, record: dict) -> None:
        """Round 0's run as the size's entry (as the files before rounds hold it), a later round's in its `repeats`."""
        if round_ == 0:
            runs[name] = record
        else:
            runs[name].setdefault("repeats", [])[round_ - 1 : round_] = [record]

    for round_, name in interleaved(options.train_sizes.split(","), options.rounds):
        size = probe[name]
        if round_ == 0:
            done = [
                r
                for r in runs.values()
                if (r["size"], r["steps"], bool(r.get("partial"))) == (size, options.steps, False)
            ]
            if done:  # the same size for as many steps, complete: not run again
                runs[name] = {**done[0]}
                continue
        elif len([r for r in runs[name].get("repeats", []) if not r.get("partial")]) >= round_:
            continue

        def save_step(marks, name=name, size=size, round_=round_):
            store(name, round_, train_record(marks, size, options, limit, error=None, partial=True))
            write_report(options, {**inputs, "train": result(partial=True)})

        warm_ups.before(name, warm_up, options, model, device, size)
        marks = Marks(device, on_step_end=save_step)
        dataset = random_dataset(options.seq_len, size * options.steps, model.config.vocab_size)
        trainer = trainer_for(options, model, size, options.steps, dataset, [marks.callback])
        marks.trainer = trainer
        error = None
        try:
            trainer.train()
        except Exception as exc:  # an OOM is the result being measured
            error = f"{type(exc).__name__}: {str(exc)[:300]}"
        store(
            name, round_, {**train_record(marks, size, options, limit, error, partial=False), "round": round_}
        )
        del trainer
        release_memory(device)
    return result(partial=False)


def warm_up(options, model, device, size: int) -> None:
    """`--warmup-steps` unrecorded steps at `size`, so that the timed run does not pay for its first shapes."""
    from adaptive_batch.runtime.memory import release_memory

    steps = options.warmup_steps
    dataset = random_dataset(options.seq_len, size * steps, model.config.vocab_size)
    trainer = trainer_for(options, model, size, steps, dataset, [])
    try:
        trainer.train()
    except Exception:  # noqa: BLE001 - an out-of-memory error is for the timed run to record
        pass
    del trainer
    release_memory(device)


def train_record(marks: Marks, size: int, options, limit: float, error: str | None, partial: bool) -> dict:
    """One training run at `size` so far: every step's time and peak reserved and allocated memory."""
    begins = [e["time"] for e in marks.events if e["event"] == "step_begin"]
    ends = [e for e in marks.events if e["event"] == "step_end"]
    seconds = [end["time"] - begin for begin, end in zip(begins, ends)]
    timed = seconds[1:] or seconds
    reserved = [e.get("peak_reserved_bytes") for e in ends]
    return {
        "size": size,
        "steps": options.steps,
        "steps_done": len(ends),
        "partial": partial,
        "error": error,
        "step_seconds": seconds,
        "tokens_per_second_after_first_step": size * options.seq_len * len(timed) / sum(timed)
        if timed
        else None,
        "peak_reserved_bytes_per_step": reserved,
        "peak_allocated_bytes_per_step": [e.get("peak_allocated_bytes") for e in ends],
        "max_reserved_within_limit": all(r is None or r <= limit for r in reserved),
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def phase_warm(options, model_dir: str, _inputs: dict) -> dict:
    """Unrecorded: the model loaded and one short training step, as a machine's first process pays for them."""
    from adaptive_batch.probe.trials import TrialRunner, make_optimizer

    model, device, dtype = load(options, model_dir)
    optimizer = make_optimizer(model, "adamw_torch" if options.tiny else "paged_adamw_8bit", 2e-4)
    autocast = None if options.tiny else dtype
    runner = TrialRunner(model, optimizer, options.seq_len, model.config.vocab_size, device, autocast, None)
    return {"warm_up_seconds": runner.warm_up().seconds}


PHASES = {
    "warm": phase_warm,
    "probe": phase_probe,
    "auto_find": phase_auto_find,
    "exhaustive": phase_exhaustive,
    "train": phase_train,
}


# -- the driver --------------------------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10, help="training steps at each of the two sizes")
    parser.add_argument(
        "--train-sizes", default="recommended,boundary", help="which of the probe's sizes to train at"
    )
    parser.add_argument("--auto-find-start", type=int, help="auto_find_batch_size's first per-device size")
    parser.add_argument(
        "--phases",
        default=",".join(p for p in PHASES if p != "warm"),
        help="comma-separated subset, in order",
    )
    parser.add_argument("--workdir", default="/tmp/adaptive-batch-bench")
    add_arguments(parser)  # the train phase's
    parser.add_argument("--tiny", action="store_true", help="a CPU dry run on a tiny model")
    parser.add_argument(
        "--resume", help="an earlier run's JSON whose phases the later ones read (the probe's)"
    )
    parser.add_argument("--phase", help=argparse.SUPPRESS)  # internal: run one phase in this process
    parser.add_argument("--inputs", help=argparse.SUPPRESS)
    options = parser.parse_args()
    model_dir = os.path.join(options.workdir, "tiny-llama" if options.tiny else "llama-2-7b-shape")

    if options.phase:
        inputs = json.loads(open(options.inputs).read())
        result = PHASES[options.phase](options, model_dir, inputs)
        print("RESULT " + json.dumps(result, default=str))
        return

    from base_model import LLAMA2_7B, TINY, save_random_llama

    os.makedirs(options.out, exist_ok=True)
    earlier = options.resume or out_path(options)
    report = json.loads(open(earlier).read()) if os.path.exists(earlier) else {}
    report.update(environment(options))
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        save_random_llama(model_dir, TINY if options.tiny else LLAMA2_7B, on_gpu=not options.tiny)
    for round_, phase in schedule(options.phases.split(","), options.rounds):
        inputs_path = os.path.join(options.workdir, "inputs.json")
        # named before the phase runs: a phase stopped partway (a train phase writes after every step) says which
        # command produced what it wrote
        report.setdefault("commands", {})[phase] = report["command"]
        with open(inputs_path, "w") as f:
            json.dump(report, f, default=str)
        argv = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--phase", phase]
        started = time.perf_counter()
        done = subprocess.run(argv + ["--inputs", inputs_path], capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            result = {"error": done.stderr[-3000:], "returncode": done.returncode}
        else:
            result = json.loads(lines[-1][len("RESULT ") :])
        result["process_seconds"] = time.perf_counter() - started
        result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        if round_ == 0:
            report[phase] = result
        else:  # a later round's run of a timed phase, kept beside the first
            report[phase].setdefault("repeats", []).append({**result, "round": round_})
        write_report(options, report)
        print(
            f"{phase}{f' (round {round_ + 1})' if round_ else ''}: {result['process_seconds']:.0f} s",
            flush=True,
        )
    print(summary(report))


TIMED = ("probe", "auto_find")  # the two phases whose times are compared


def schedule(phases: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, phase) in the order to run them. Where both timed phases are asked for, an unrecorded `warm` process
    comes first (so that neither is the machine's first process on the GPU, with cold caches) and the two run in
    `rounds` order-reversed rounds in place of the first of them; the other phases run once, in their place."""
    if not all(p in phases for p in TIMED):
        return [(0, p) for p in phases]
    first = min(phases.index(p) for p in TIMED)
    rest = [p for p in phases if p not in TIMED]
    timed = [(0, "warm"), *interleaved(list(TIMED), rounds)]
    return [(0, p) for p in rest[:first]] + [(r, p) for r, p in timed] + [(0, p) for p in rest[first:]]


def environment(options) -> dict:
    import platform

    import torch
    import transformers

    return {
        "seq_len": options.seq_len,
        "command": "python3 benchmarks/probe_boundary.py " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else platform.processor() or "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "date": time.strftime("%Y-%m-%d"),
    }


def time_ratios(report: dict) -> list[tuple[float, float]]:
    """(probe seconds, auto_find's lost seconds) of each round both phases finished."""
    probe, auto = report.get("probe", {}), report.get("auto_find", {})
    probes = {0: probe, **{r.get("round"): r for r in probe.get("repeats", [])}}
    autos = {0: auto, **{r.get("round"): r for r in auto.get("repeats", [])}}
    return [
        (probes[r]["seconds"], autos[r]["lost_seconds"])
        for r in sorted(probes)
        if r in autos and "seconds" in probes[r] and autos[r].get("lost_seconds")
    ]


def gib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**30:.1f}"  # no reading on the CPU


def summary(report: dict) -> str:
    lines = [f"sequence length {report['seq_len']}"]
    probe, auto, exhaustive, train = (
        report.get(k, {}) for k in ("probe", "auto_find", "exhaustive", "train")
    )
    if "boundary" in probe:
        lines.append(
            f"probe: boundary {probe['boundary']} (first failing {probe['first_failing']}), recommended "
            f"{probe['recommended']}, {probe['seconds']:.1f} s ({probe['wall_seconds_including_model_load']:.1f} s "
            f"with loading), sizes {[t['size'] for t in probe['trials']]}"
        )
        if "overhead_seconds" in probe:  # reports from before the breakdown have only the warm-up's time
            trials = ", ".join(
                f"{t['size']}: ~{t['seconds']:.2f} (its forward {t['forward_seconds']:.2f})"
                if t.get("forward_only")
                else f"{t['size']}: {t['seconds']:.2f}"
                for t in probe["trials"]
                if t["seconds"]
            )
            lines.append(
                f"probe time: warm-up {probe['warm_up_seconds']:.2f} s ({probe['warm_up_tokens']} tokens), trials "
                f"{probe['trial_seconds']:.2f} s ({trials}), the rest {probe['overhead_seconds']:.2f} s (setup "
                f"{probe['setup_seconds']:.2f} s, cleanup {probe['cleanup_seconds']:.2f} s)"
            )
    if "lost_seconds" in auto:
        lines.append(
            f"auto_find_batch_size: from {auto['start']}, tried {auto['sizes_tried']}, lost "
            f"{auto['lost_seconds']:.1f} s"
        )
        rounds = time_ratios(report)
        if rounds:
            by_round = ", ".join(f"{probe_s:.1f} / {lost:.1f} s" for probe_s, lost in rounds)
            pooled = sum(p for p, _ in rounds) / sum(lost for _, lost in rounds)
            lines.append(f"probe / lost = {pooled:.3f} over {len(rounds)} round(s) ({by_round})")
    if "true_boundary" in exhaustive:
        true = exhaustive["true_boundary"]
        off = abs(probe["boundary"] - true) / true if true else math.nan
        lines.append(
            f"exhaustive {exhaustive['window']}: true boundary {true} (monotone {exhaustive['monotone']}); "
            f"the probe's is {off:.1%} off"
        )
    for name, run in train.get("runs", {}).items():
        reserved = [r for r in run["peak_reserved_bytes_per_step"] if r is not None] or [None]
        speed = run["tokens_per_second_after_first_step"] or 0
        lines.append(
            f"train {name} {run['size']}: {run['steps_done']} steps{' (partial)' if run.get('partial') else ''}, "
            f"error {run['error']}, {speed:,.0f} tokens/s, reserved {gib(reserved[0])} GiB at the first step, "
            f"{gib(reserved[-1])} GiB at the last, {gib(max(reserved, key=lambda r: r or 0))} GiB at most, within "
            f"limit {run['max_reserved_within_limit']}"
        )
        for repeat in run.get("repeats", []):
            lines.append(
                f"  again (round {repeat.get('round', '-')}): {repeat['steps_done']} steps, error {repeat['error']}, "
                f"{repeat['tokens_per_second_after_first_step'] or 0:,.0f} tokens/s, within limit "
                f"{repeat['max_reserved_within_limit']}"
            )
    for phase in ("probe", "auto_find", "exhaustive", "train"):
        if "error" in report.get(phase, {}) and "returncode" in report[phase]:
            lines.append(f"{phase} FAILED: {report[phase]['error'][-800:]}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
