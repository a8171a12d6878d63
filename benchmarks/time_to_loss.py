"""Time to a target eval loss: fixed effective batches, a phase warmup and NoiseScaleSchedule, from scratch.

A Llama-shaped model of about 34M parameters (hidden 512, 8 layers, vocabulary 8,192) trained from random weights on
the offline corpus of `corpus.py` (Python source, rows of 256 tokens), bf16, AdamW, cosine decay with 2% warmup
(in samples: every arm has the same schedule over the same sample budget), the same sample order in every arm (one
data seed). Arms:

- `fixed16` ... `fixed256`: a constant effective batch, 16x range;
- `phase`: 16 -> 32 -> 64 -> 128 -> 256 at 1/16, 1/8, 1/4 and 1/2 of the budget, `lr_scaling="sqrt"`;
- `noise`: `NoiseScaleSchedule(16, max_size=256, min_efficiency=None)` (goodput alone, the default when it ran),
  `lr_scaling="sqrt"`.

Every arm runs `AdaptiveBatch` with `micro_batch_size="auto"`, so the micro-batch is chosen the same way in all.
The arms run in blocks (one per seed, and in the grid one per seed and LR), every other block in reverse order, so
that every arm's mean position is the same; before its first timed run each arm trains on `--warmup-rows` rows
(default 512), unrecorded (see rounds.py). The held-out loss (the corpus's last rows) is evaluated every
`--eval-every` samples; evaluation time is excluded from the training clock. Each run's JSON holds (samples, steps,
training seconds, eval loss) at every evaluation, and the log history (effective batch, noise scale, LR).

    python benchmarks/time_to_loss.py --out OUT --corpus .corpus --phase grid            # every arm x LR, seed 0
    python benchmarks/time_to_loss.py --out OUT --corpus .corpus --phase seeds --best RESULTS.json   # seeds 0, 1, 2
    python benchmarks/time_to_loss.py --out OUT --tiny                                   # a CPU dry run

`summarise(runs)` picks each arm's learning rate by its final eval loss on seed 0, sets the target to the median of
the fixed arms' final eval losses at their best learning rates, and reports the training time, steps, samples and
tokens at which each run first evaluated at or below the target.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import numpy as np
import torch
from common import EvalClock, device_name, first_at, save, scratch_model, versions
from rounds import WarmUps

ARMS = ("fixed16", "fixed32", "fixed64", "fixed128", "fixed256", "phase", "noise")
LEARNING_RATES = (1.5e-3, 7.5e-4, 3e-3)  # the middle one first
LARGEST_BATCH = 256  # fixed256, and where phase and noise grow to: a warm-up needs a step's samples


def load_rows(corpus: str | None, seq_len: int, train_rows: int, eval_rows: int, tiny: bool):
    """(train rows, eval rows, vocabulary size, corpus description): non-overlapping windows of `seq_len` tokens."""
    if tiny:
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 128, ((train_rows + eval_rows) * seq_len,), generator=generator)
        vocab, info = 128, {"corpus": "random tokens (tiny dry run)"}
    else:
        tokens = torch.from_numpy(np.load(os.path.join(corpus, "tokens.npz"))["tokens"].astype(np.int64))
        with open(os.path.join(corpus, "corpus.json")) as f:
            info = json.load(f)
        vocab = info["vocab"]
    windows = tokens[: len(tokens) // seq_len * seq_len].view(-1, seq_len)
    if len(windows) < train_rows + eval_rows:
        raise ValueError(
            f"The corpus holds {len(windows)} rows of {seq_len}; {train_rows + eval_rows} needed."
        )
    train = [{"input_ids": row, "labels": row} for row in windows[:train_rows]]
    held_out = windows[-eval_rows:]
    return train, held_out, vocab, info


def schedule_for(arm: str, lr_scaling_out: dict):
    from adaptive_batch import NoiseScaleSchedule, PhaseSchedule

    if arm.startswith("fixed"):
        lr_scaling_out["rule"] = "none"
        return int(arm[len("fixed") :])
    lr_scaling_out["rule"] = "sqrt"
    if arm == "phase":
        return PhaseSchedule([16, 32, 64, 128, 256], boundaries=[1 / 16, 1 / 8, 1 / 4, 1 / 2])
    if arm == "noise":
        return NoiseScaleSchedule(16, max_size=256, min_efficiency=None)
    raise ValueError(f"unknown arm {arm!r}; one of {ARMS}")


def run(arm: str, lr: float, seed: int, data, options) -> dict:
    from transformers import Trainer, TrainingArguments

    from adaptive_batch import AdaptiveBatch

    train, held_out, vocab, _ = data
    model = scratch_model(vocab, options.seq_len, options.tiny, seed)
    if torch.cuda.is_available():
        model = model.cuda()
    rule: dict = {}
    schedule = schedule_for(arm, rule)
    callback = AdaptiveBatch(schedule=schedule, lr_scaling=rule["rule"])
    clock = EvalClock(held_out, options.eval_every, callback)
    args = TrainingArguments(
        output_dir=os.path.join(options.workdir, f"{arm}-{lr:g}-{seed}"),
        per_device_train_batch_size=16,
        num_train_epochs=1,
        learning_rate=lr,
        lr_scheduler_type="cosine",
        warmup_steps=0.02,  # a ratio of the (nominal) steps
        weight_decay=0.1,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        bf16=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),
        logging_steps=20,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=seed,
        data_seed=0,  # the same sample order in every arm and seed
        dataloader_pin_memory=False,
    )
    trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[callback, clock.callback])
    began = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - began
    result = {
        "arm": arm,
        "lr": lr,
        "seed": seed,
        "wall_seconds": wall,
        "train_seconds": clock.points[-1]["train_seconds"],
        "steps": trainer.state.global_step,
        "points": clock.points,
        "changes": [c.__dict__ for c in getattr(schedule, "changes", [])],
        "logs": [
            {
                k: v
                for k, v in log.items()
                if k.startswith("adaptive_batch/") or k in ("loss", "learning_rate", "step")
            }
            for log in trainer.state.log_history
            if "loss" in log
        ],
    }
    del trainer, model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def to_target(run: dict, target: float, seq_len: int) -> dict:
    """A run's arm, LR, seed, final eval loss, and the time, steps, samples and tokens at which it first evaluated
    at or below `target` (`None`s if it never did)."""
    point = first_at(run["points"], target)
    return {
        "arm": run["arm"],
        "lr": run["lr"],
        "seed": run["seed"],
        "final_eval_loss": run["points"][-1]["eval_loss"],
        "seconds_to_target": point["train_seconds"] if point else None,
        "steps_to_target": point["step"] if point else None,
        "samples_to_target": point["samples"] if point else None,
        "tokens_to_target": point["samples"] * seq_len if point else None,
    }


def summarise(runs: list[dict], seq_len: int) -> dict:
    """Best LR per arm (seed 0, final eval loss), the target, and each run's time, steps, samples and tokens to it."""
    best = {}
    for arm in ARMS:
        candidates = [r for r in runs if r["arm"] == arm and r["seed"] == 0]
        if candidates:
            best[arm] = min(candidates, key=lambda r: r["points"][-1]["eval_loss"])["lr"]
    fixed_final = [
        r["points"][-1]["eval_loss"]
        for r in runs
        if r["arm"].startswith("fixed") and r["seed"] == 0 and best.get(r["arm"]) == r["lr"]
    ]
    if not fixed_final:
        return {"best_lr": best}
    target = statistics.median(fixed_final)
    table = []
    for r in runs:
        if best.get(r["arm"]) != r["lr"]:
            continue
        table.append({**to_target(r, target, seq_len), "total_train_seconds": r["train_seconds"]})
    # a run that never reached the target counts as infinitely slow: an arm's median is finite when most of its seeds
    # reached it (None in the JSON otherwise)
    by_arm, medians = {}, {}
    for arm in ARMS:
        times = [row["seconds_to_target"] for row in table if row["arm"] == arm]
        if times:
            medians[arm] = statistics.median(t if t is not None else math.inf for t in times)
            by_arm[arm] = {
                "runs": len(times),
                "reached": sum(t is not None for t in times),
                "median_seconds_to_target": medians[arm] if math.isfinite(medians[arm]) else None,
            }
    fixed = sorted(medians[a] for a in medians if a.startswith("fixed"))
    summary = {"best_lr": best, "target_eval_loss": target, "table": table, "by_arm": by_arm}
    if fixed and math.isfinite(fixed[0]) and "noise" in medians:
        summary["best_fixed_seconds"] = fixed[0]
        summary["median_fixed_seconds"] = statistics.median(fixed)
        for arm in ("noise", "phase"):
            if arm in medians and math.isfinite(medians[arm]):
                summary[f"{arm}_over_best_fixed"] = medians[arm] / fixed[0]
                summary[f"{arm}_over_median_fixed"] = medians[arm] / statistics.median(fixed)
    return summary


def compare(runs: list[dict], target: float, seq_len: int) -> dict:
    """Each run's time, steps, samples and tokens to `target`, each arm's median time over its runs (a run that
    never reached the target counts as infinitely slow), and each arm's median over fixed64's: for runs made in one
    call, interleaved, so that they share the machine's state (`--compare`)."""
    table = []
    for r in runs:
        table.append(
            {**to_target(r, target, seq_len), "changes": [(c["step"], c["size"]) for c in r["changes"]]}
        )
    medians = {}
    for arm in dict.fromkeys(row["arm"] for row in table):
        times = [row["seconds_to_target"] for row in table if row["arm"] == arm]
        medians[arm] = statistics.median(math.inf if t is None else t for t in times)
    reference = medians.get("fixed64")
    return {
        "target_eval_loss": target,
        "table": table,
        "median_seconds_to_target": {a: m if math.isfinite(m) else None for a, m in medians.items()},
        "over_fixed64": {
            a: m / reference for a, m in medians.items() if reference and math.isfinite(m * reference)
        },
    }


def plot_curves(runs: list[dict], target: float, out: str, label=lambda r: r["arm"]) -> None:
    """Eval loss against training seconds and effective batch against samples, one line per run."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.5))
    FigureCanvasAgg(figure)
    loss_axes, batch_axes = figure.subplots(1, 2)
    for r in runs:
        points = [p for p in r["points"] if p["samples"] > 0]
        loss_axes.plot([p["train_seconds"] for p in points], [p["eval_loss"] for p in points], label=label(r))
        sizes = [
            (log["adaptive_batch/samples_seen"], log["adaptive_batch/effective_batch_size"])
            for log in r["logs"]
        ]
        batch_axes.step([x for x, _ in sizes], [y for _, y in sizes], where="post", label=label(r))
    loss_axes.axhline(target, color="grey", linestyle="--", linewidth=1, label="target")
    loss_axes.set(xlabel="training seconds (evaluation excluded)", ylabel="held-out loss", ylim=(4.2, 6.5))
    batch_axes.set(xlabel="samples seen", ylabel="effective batch (logged every 20 steps)", yscale="log")
    loss_axes.legend(fontsize=8)
    batch_axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=90)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--corpus", default=".corpus")
    parser.add_argument("--phase", choices=("grid", "seeds"), default="grid")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--lrs", default=",".join(f"{lr:g}" for lr in LEARNING_RATES))
    parser.add_argument("--seeds", help="comma-separated (default: 0 in the grid, 0,1,2 in the seeds phase)")
    parser.add_argument("--best", help="a grid phase's JSON: run each arm at its best LR (--phase seeds)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--train-rows", type=int, default=24576)
    parser.add_argument("--eval-rows", type=int, default=256)
    parser.add_argument("--eval-every", type=int, default=512, help="samples between evaluations")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument(
        "--summarise", nargs="+", metavar="JSON", help="merge these results' runs and summarise"
    )
    parser.add_argument(
        "--compare", nargs="+", metavar="JSON", help="these results' runs against each other (with --target)"
    )
    parser.add_argument("--target", type=float, help="the eval loss --compare times the runs to")
    parser.add_argument("--name", default="compare", help="--compare writes time_to_loss_NAME.json")
    parser.add_argument("--workdir", default="/tmp/adaptive-batch-time-to-loss")
    parser.add_argument(
        "--warmup-rows",
        type=int,
        default=512,
        help="before each arm's first timed run, the same arm on this many rows, unrecorded (0: none)",
    )
    options = parser.parse_args()
    if 0 < options.warmup_rows < LARGEST_BATCH:
        parser.error(
            f"--warmup-rows {options.warmup_rows} is below the largest effective batch an arm reaches, "
            f"{LARGEST_BATCH}; use 0 (no warm-up) or at least {LARGEST_BATCH}"
        )
    os.makedirs(options.out, exist_ok=True)
    if options.compare:
        if options.target is None:
            parser.error("--compare needs --target, the eval loss to time the runs to")
        runs = []
        for name in options.compare:
            with open(name) as f:
                runs.extend(json.load(f)["runs"])
        result = {"sources": options.compare, **compare(runs, options.target, options.seq_len)}
        save(result, os.path.join(options.out, f"time_to_loss_{options.name}.json"))
        plot_curves(
            runs,
            options.target,
            os.path.join(options.out, f"time_to_loss_{options.name}.png"),
            label=lambda r: f"{r['arm']} seed {r['seed']}",
        )
        print(json.dumps({k: result[k] for k in ("median_seconds_to_target", "over_fixed64")}, indent=1))
        return
    if options.summarise:
        runs = []
        for name in options.summarise:
            with open(name) as f:
                runs.extend(json.load(f)["runs"])
        summary = summarise(runs, options.seq_len)
        save(
            {"sources": options.summarise, "summary": summary},
            os.path.join(options.out, "time_to_loss_summary.json"),
        )
        best = summary["best_lr"]  # each arm at its best LR, seed 0
        chosen = [r for r in runs if r["seed"] == 0 and best.get(r["arm"]) == r["lr"]]
        plot_curves(chosen, summary["target_eval_loss"], os.path.join(options.out, "time_to_loss_h200.png"))
        print(json.dumps(summary, indent=1))
        return

    data = load_rows(options.corpus, options.seq_len, options.train_rows, options.eval_rows, options.tiny)
    arms = options.arms.split(",")
    seeds = [int(s) for s in (options.seeds or ("0,1,2" if options.phase == "seeds" else "0")).split(",")]
    if options.phase == "seeds":
        with open(options.best) as f:
            best = summarise(json.load(f)["runs"], options.seq_len)["best_lr"]
        blocks = [[(arm, best[arm], seed) for arm in arms] for seed in seeds]
    else:
        # every arm at one LR before the next LR: a call cut short still holds whole rows of the grid
        blocks = [[(arm, float(lr), seed) for arm in arms] for seed in seeds for lr in options.lrs.split(",")]
    # every other block in reverse order, so that every arm's mean position is the same
    plan = [run_ for i, block in enumerate(blocks) for run_ in (block if i % 2 == 0 else block[::-1])]
    report = {
        "command": " ".join(sys.argv),
        "device": device_name(),
        "versions": versions(),
        "corpus": data[3],
        "seq_len": options.seq_len,
        "train_rows": options.train_rows,
        "eval_rows": options.eval_rows,
        "runs": [],
    }
    path = os.path.join(options.out, f"time_to_loss_{options.phase}.json")
    # CUDA, the kernels and each arm's shapes warmed up before its first timed run
    warm_ups = WarmUps(options.warmup_rows, unit="rows")
    report["warmup"] = warm_ups.record()
    warm_data = (data[0][: options.warmup_rows], data[1], data[2], data[3])
    for arm, lr, seed in plan:
        warm_ups.before(arm, run, arm, lr, seed, warm_data, options)
        result = run(arm, lr, seed, data, options)
        report["runs"].append(result)
        report["summary"] = summarise(report["runs"], options.seq_len)
        save(report, path)
        sizes = sorted({log.get("adaptive_batch/effective_batch_size") for log in result["logs"]} - {None})
        print(
            f"{arm:9} lr {lr:<7g} seed {seed}: {result['train_seconds']:7.1f} s train, {result['steps']:5} steps, "
            f"final eval {result['points'][-1]['eval_loss']:.4f}, batches {sizes}",
            flush=True,
        )
    print(json.dumps({k: v for k, v in report["summary"].items() if k != "table"}, indent=1))


if __name__ == "__main__":
    main()
