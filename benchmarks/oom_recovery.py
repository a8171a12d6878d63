"""An out-of-memory error at the boundary costs one step: one step of rows four times the usual length, in a run whose
fixed micro-batch fits with little memory to spare, against the same run without that step, interleaved.

The setup is qlora_throughput.py's (Llama-2-7B shape with random weights, NF4 QLoRA, LoRA r=16 on q/v, gradient
checkpointing, paged 8-bit AdamW), rows of `--seq-len` random tokens, the user's M x A with
`AdaptiveBatch(micro_batch_size=M)`, the rows in order (`train_sampling_strategy="sequential"`), so that step
`--long-step` holds the only long rows (4 x the length) and every other step the same rows in both arms.

The boundary is memory's, set per `--caps` entry: the memory the micro-batches may use above the model's (weights,
optimizer), in units of what a usual step used in a calibration run (an unrecorded run of `--calibration-steps`
without the long step and without a cap). A cap of 1.5 puts the usual micro-batch at the boundary (1.5 M rows of the
usual length would fit, 2 M would not), so the long step fails at M and at M / 2 and runs at M / 4; a cap of 3 lets
it run at M / 2. On CUDA the cap is real: `torch.cuda.set_per_process_memory_fraction` over the caching allocator's
reserved bytes. On the CPU (`--tiny`) `adaptive_batch.testing.FakeOutOfMemory` stands for it: a forward of more than
cap x M x seq_len tokens raises `torch.OutOfMemoryError` (at a cap of 3, once: the long step at M).

AdaptiveBatch halves the micro-batch, runs the step again, and a step later tries the size that failed again.
Under each cap the two arms run in `--rounds` rounds (default 2), every other one in reverse order, and each arm
trains `--warmup-steps` (default 1) unrecorded steps of its own under that cap before its first timed run (see
rounds.py).
Reported per arm: every step's seconds, real tokens, logged micro-batch size and forwards (failed ones included),
the warnings AdaptiveBatch logged (with their step), `current()` at the end, peak memory; per cap: real tokens/s
over the steps after recovery (from the first step after the long one that runs at M again, or the step after the
long one where none does) relative to the same steps of the run without the long step (the aim: at least 0.97), the
long step's own seconds against the usual step's.

Usage (results go to OUT/oom_recovery.json, written after every arm, and a table at the end):

    python3 benchmarks/oom_recovery.py --out $OUT --time-limit 480
    python benchmarks/oom_recovery.py --out /tmp/out --tiny     # a CPU dry run of the same code on a tiny model
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics

import torch
from base_model import header, qlora_trainer
from common import Deadline, StepClock, build_model, increments, logged, save, train
from ragged_throughput import step_record
from rounds import WarmUps, add_arguments, interleaved

LONGER = 4  # the long step's rows, in usual lengths
AFTER_RECOVERY_AIM = 0.97


class Warnings(logging.Handler):
    """The warnings of the `adaptive_batch` loggers while it is entered, each with the step (0-based) it came in;
    `callback` goes to the Trainer."""

    def __init__(self):
        from transformers import TrainerCallback

        super().__init__(logging.WARNING)
        handler = self
        self.step = -1
        self.records: list[dict] = []

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                handler.step = state.global_step

        self.callback = Callback()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append({"step": self.step, "level": record.levelname, "message": record.getMessage()})

    def __enter__(self) -> Warnings:
        logging.getLogger("adaptive_batch").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("adaptive_batch").removeHandler(self)


def make_rows(options, vocab_size: int, long_step: int | None) -> list[dict]:
    """Rows of `seq_len` random tokens for every step; those of `long_step` (if any) `LONGER` times as long, drawn
    apart, so that the other steps hold the same rows with or without it."""

    def draw(count: int, length: int, seed: int) -> list[dict]:
        ids = torch.randint(0, vocab_size, (count, length), generator=torch.Generator().manual_seed(seed))
        return [{"input_ids": row, "attention_mask": [1] * length, "labels": row} for row in ids.tolist()]

    batch = options.micro * options.accumulation
    rows = draw(batch * options.steps, options.seq_len, 0)
    if long_step is not None:
        rows[long_step * batch : (long_step + 1) * batch] = draw(batch, LONGER * options.seq_len, 1)
    return rows


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def run_arm(name, model, rows, steps, cap_tokens, options) -> dict:
    """One run of `steps` steps at the user's M x A with `AdaptiveBatch(micro_batch_size=M)`; `cap_tokens`: on the
    CPU, the tokens a forward may hold before the fake out-of-memory error (`None`: no limit)."""
    from adaptive_batch import AdaptiveBatch
    from adaptive_batch.runtime.memory import release_memory
    from adaptive_batch.testing import FakeOutOfMemory

    clock, adaptive = StepClock(), AdaptiveBatch(micro_batch_size=options.micro)
    with Warnings() as warnings:
        trainer = qlora_trainer(
            model,
            rows,
            [clock.callback, adaptive, warnings.callback],
            os.path.join(options.workdir, "trainer"),
            options.micro,
            options.accumulation,
            steps,
            options.tiny,
            train_sampling_strategy="sequential",
        )
        # a limit, as the memory cap is on CUDA (at a cap of 3 only the long step at M exceeds it: it raises once)
        fake = None if cap_tokens is None else FakeOutOfMemory(trainer.model, None, max_tokens=cap_tokens)
        try:
            forwards = train(trainer)
        finally:
            if fake is not None:
                fake.remove()
    result = {
        "arm": name,
        **step_record(clock.step_seconds, increments(logged(trainer, "adaptive_batch/tokens_seen"))),
        "micro_batch_size_per_step": logged(trainer, "adaptive_batch/micro_batch_size"),
        "forwards_per_step": forwards,
        "warnings": warnings.records,
        "fake_out_of_memory_raised_at_rows": None if fake is None else fake.raised,
        "current": adaptive.current(),
        "losses": logged(trainer, "loss"),
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else None,
    }
    del trainer
    release_memory(device())
    return result


def calibrate(model, rows, options, deadline: Deadline) -> dict:
    """Memory of the usual steps, without a cap: the caching allocator's reserved bytes before training (the model)
    and at the peak of an unrecorded run without the long step (on CUDA; the CPU measures nothing)."""
    from adaptive_batch.runtime.memory import release_memory

    release_memory(device())
    base = torch.cuda.memory_reserved() if torch.cuda.is_available() else None
    run = deadline.run(run_arm, "calibration", model, rows, options.calibration_steps, None, options)
    return {
        "steps": options.calibration_steps,
        "seconds": run["seconds"],
        "base_reserved_bytes": base,
        "peak_reserved_bytes": None if base is None else run["peak_reserved_gib"] * 2**30,
        "total_bytes": torch.cuda.get_device_properties(0).total_memory
        if torch.cuda.is_available()
        else None,
        "micro_batch_size_per_step": run["micro_batch_size_per_step"],
    }


def apply_cap(cap: float, calibration: dict, options) -> dict:
    """Set the limit for `cap` (see the module docstring): a memory fraction on CUDA, the fake's tokens on the CPU."""
    if calibration["base_reserved_bytes"] is None:
        return {"cap": cap, "fake_max_tokens": int(cap * options.micro * options.seq_len)}
    base, peak = calibration["base_reserved_bytes"], calibration["peak_reserved_bytes"]
    limit = base + cap * (peak - base)
    fraction = min(1.0, limit / calibration["total_bytes"])
    torch.cuda.set_per_process_memory_fraction(fraction)
    return {"cap": cap, "limit_bytes": limit, "memory_fraction": fraction}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="a CPU dry run on a tiny model")
    parser.add_argument("--seq-len", type=int, help="tokens of a usual row (default 1024; 32 with --tiny)")
    parser.add_argument(
        "--micro", type=int, default=8, help="M: per-device batch and AdaptiveBatch's micro-batch"
    )
    parser.add_argument("--accumulation", type=int, default=2, help="A: the user's gradient accumulation")
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps of each arm")
    parser.add_argument("--long-step", type=int, default=4, help="the step (0-based) of long rows")
    parser.add_argument(
        "--caps", default="1.5,3", help="comma-separated caps, in usual steps' memory (see above)"
    )
    add_arguments(parser)
    parser.add_argument("--calibration-steps", type=int, default=2)
    parser.add_argument(
        "--time-limit", type=float, default=0, help="start no arm that would end after this (s)"
    )
    parser.add_argument("--workdir", default="/tmp/adaptive-batch-bench")
    options = parser.parse_args()
    options.seq_len = options.seq_len or (32 if options.tiny else 1024)
    if not 0 < options.long_step < options.steps - 1:
        parser.error(f"--long-step {options.long_step} must leave a step before it and one after it")
    os.makedirs(options.out, exist_ok=True)
    os.makedirs(options.workdir, exist_ok=True)
    deadline = Deadline(options.time_limit)

    model, config = build_model(options.tiny, options.workdir)
    datasets = {
        "usual": make_rows(options, config.vocab_size, None),
        "long_step": make_rows(options, config.vocab_size, options.long_step),
    }
    report = {
        **header(options.tiny, ("peft",)),
        "seq_len": options.seq_len,
        "pair": f"{options.micro}x{options.accumulation}",
        "long_step": options.long_step,
        "long_rows": f"{LONGER} x {options.seq_len} tokens",
        "calibration": calibrate(model, datasets["usual"], options, deadline),
        "caps": [],
        "not_run": [],
    }
    path = os.path.join(options.out, "oom_recovery.json")
    for cap in map(float, options.caps.split(",")):
        limit = apply_cap(cap, report["calibration"], options)
        warm_ups = WarmUps(options.warmup_steps)  # under each cap, each arm's own
        entry = {**limit, "warmup": warm_ups.record(), "runs": []}
        report["caps"].append(entry)
        for round_, name in interleaved(list(datasets), options.rounds):
            if not deadline.allows_another():
                report["not_run"].append({"cap": cap, "round": round_, "arm": name})
                continue
            rows, cap_tokens = datasets[name], limit.get("fake_max_tokens")
            warm_ups.before(name, run_arm, name, model, rows, options.warmup_steps, cap_tokens, options)
            result = {
                "round": round_,
                **deadline.run(run_arm, name, model, rows, options.steps, cap_tokens, options),
            }
            entry["runs"].append(result)
            entry["summary"] = summarise(entry["runs"], options)
            save(report, path)
            print(
                f"cap {cap} {name:>9}: sizes {result['micro_batch_size_per_step']}, forwards "
                f"{result['forwards_per_step']}, {len(result['warnings'])} warnings, in {result['seconds']:.0f} s",
                flush=True,
            )
    if torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(1.0)
    save(report, path)
    print_table(report)


def recovered_at(run: dict, options) -> int:
    """The first step after the long one that runs at M again; the step after the long one where none does."""
    sizes = run["micro_batch_size_per_step"]
    after = range(options.long_step + 1, len(sizes))
    return next((step for step in after if sizes[step] == options.micro), options.long_step + 1)


def speed(runs: list[dict], steps: slice) -> float:
    """Real tokens over seconds of `steps`, the runs pooled."""
    return sum(sum(r["real_tokens_per_step"][steps]) for r in runs) / sum(
        sum(r["step_seconds"][steps]) for r in runs
    )


def summarise(runs: list[dict], options) -> dict:
    """Real tokens/s after recovery in the runs with the long step over the same steps without it, pooled over the
    rounds; whether every run came back to M, and the long step's cost."""
    usual = [r for r in runs if r["arm"] == "usual"]
    long_ = [r for r in runs if r["arm"] == "long_step"]
    summary = {"recovered_at": [recovered_at(r, options) for r in long_]}
    summary["micro_batch_after"] = [
        r["micro_batch_size_per_step"][s] for r, s in zip(long_, summary["recovered_at"])
    ]
    summary["back_at_micro_batch"] = [size == options.micro for size in summary["micro_batch_after"]]
    if usual and long_:
        after = slice(max(summary["recovered_at"]), None)
        ratio = speed(long_, after) / speed(usual, after)
        summary.update(
            after_recovery_steps=[after.start, options.steps],
            after_recovery_ratio=ratio,
            after_recovery_aim=AFTER_RECOVERY_AIM,
            after_recovery_met=ratio >= AFTER_RECOVERY_AIM,
            long_step_seconds=[r["step_seconds"][options.long_step] for r in long_],
            usual_step_seconds=statistics.median(s for r in usual for s in r["step_seconds"][1:]),
        )
    return summary


def print_table(report: dict) -> None:
    print(
        f"\n{report['device']}, {report['model']}, {report['pair']} with AdaptiveBatch(micro_batch_size="
        f"{report['pair'].split('x')[0]}), rows of {report['seq_len']} tokens, step {report['long_step']} of "
        f"{report['long_rows']}"
    )
    print(
        f"{'cap':>4} {'round':>5} {'arm':>9} {'micro-batch per step':>32} {'forwards per step':>32} {'warnings':>8}"
    )
    for entry in report["caps"]:
        for run in entry["runs"]:
            sizes = " ".join(map(str, run["micro_batch_size_per_step"]))
            forwards = " ".join(map(str, run["forwards_per_step"]))
            print(
                f"{entry['cap']:>4} {run['round']:>5} {run['arm']:>9} {sizes:>32} {forwards:>32} "
                f"{len(run['warnings']):>8}"
            )
    for entry in report["caps"]:
        summary = entry.get("summary", {})
        where = f", memory fraction {entry['memory_fraction']:.3f}" if "memory_fraction" in entry else ""
        if "after_recovery_ratio" not in summary:
            print(f"cap {entry['cap']}{where}: not both arms run")
            continue
        met = "met" if summary["after_recovery_met"] else "MISSED"
        after = ", ".join(
            f"{'back at' if back else 'NOT back: at'} {size} from step {step}"
            for size, back, step in zip(
                summary["micro_batch_after"], summary["back_at_micro_batch"], summary["recovered_at"]
            )
        )
        print(
            f"cap {entry['cap']}{where}: {after}; tokens/s over steps {summary['after_recovery_steps'][0]}-"
            f"{summary['after_recovery_steps'][1] - 1} x{summary['after_recovery_ratio']:.3f} of the run without the "
            f"long step (aim >= {AFTER_RECOVERY_AIM}: {met}); the long step "
            f"{', '.join(f'{s:.1f}' for s in summary['long_step_seconds'])} s, a usual one "
            f"{summary['usual_step_seconds']:.1f} s"
        )
        seen: dict[tuple, int] = {}  # each warning once, with the number of runs that logged it
        for run in entry["runs"]:
            for warning in run["warnings"]:
                key = (run["arm"], warning["step"], warning["message"])
                seen[key] = seen.get(key, 0) + 1
        for (arm, step, message), runs in seen.items():
            print(f"  {arm} step {step} ({runs} runs): {message[:140]}")
    if report["not_run"]:
        print(f"not run (time limit): {len(report['not_run'])} arms")


if __name__ == "__main__":
    main()
