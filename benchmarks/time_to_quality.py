"""Time to quality (issue 25): fixed batches at their best LR against schedules with no sweep, from scratch and in
fine-tuning (full and LoRA), 3 seeds interleaved.

Setups:

- `scratch`: the 34M Llama-shaped model of `time_to_loss.py` from random weights on corpus A, the Python source of
  `corpus.py` (`--train-rows` rows of `--seq-len` tokens, one epoch);
- `full` and `lora`: a base pretrained in the same call on corpus A (`--base-rows` rows at a fixed batch of
  `--base-batch`, seed 0, saved under `--workdir`), then fine-tuned on corpus B, English text tokenised with corpus
  A's tokenizer: Python's documentation topics (`pydoc_data.topics`) and the long descriptions (READMEs) in the
  `METADATA` files of the directories given to `--prepare-english` (stored as `english.npz` beside the corpus, so
  that it travels with it), for `--ft-epochs` epochs; `full` trains every weight, `lora` a LoRA adapter (peft,
  r=`--lora-r` on every linear layer of the blocks).

Arms (with `--start` S, 16 by default):

- `fixedS` ... `fixed16S`: a constant effective batch over a 16x range, each at its best LR of a small grid (the
  `grid` phase, seed 0, final eval loss);
- `phase`: S -> 2S -> 4S -> 8S -> 16S at 1/16, 1/8, 1/4 and 1/2 of the budget, `lr_scaling="sqrt"`;
- `noise`: `NoiseScaleSchedule(S, max_size=16S, min_efficiency=None)` (goodput alone, the default when these ran);
- `noise_eff0.9`, `noise_eff0.95`: the same with `min_efficiency` 0.9 and 0.95 (`--efficiencies`);
- `seesaw`: Seesaw (Meterez et al., 2025) on the cosine schedule: where the cosine would have halved the LR, the
  batch doubles instead and the LR rule `sqrt` multiplies the LR by sqrt(2) (so each halving becomes a division by
  sqrt(2) and a doubling of the batch), S -> 16S at the cosine's halvings after the warmup (`seesaw_boundaries`);
- `late`: the late switch (issue 33): S for the first `LATE_AT` = 0.7 of the budget, then `LATE_FACTOR` = 8 x S to
  the end, one switch, `lr_scaling="sqrt"` (at the switch the LR is multiplied by sqrt(8) = 2.83: the cosine is at
  0.21 of its peak there, so the LR goes back to 0.61 of it and decays from there). Why 0.7 and 8x (the issue
  allows 0.6-0.8 and 4x-8x): against `fixedS` the arm costs about f + (1 - f) c of its time, f the fraction at S
  and c the cost per sample at 8S over that at S, about 0.19 on the H200 for this model (`time_to_loss.py`: one
  epoch at 16 took 60 s, at 128 11.5 s, at 64 15 s, so 4x would give c = 0.25 and little more time saved); 0.7
  puts the arm at about 0.76 T, under the goal's 0.8 T with some room for the seeds' spread, where 0.8 (0.84 T)
  could not meet it and 0.6 would hand 40% of the data to the large batch; and `time_to_loss.py`'s noise arm, on
  this model from scratch, had grown to 8S = 128 by a third of its budget (its measured noise scale allowing it),
  so 8S at 0.7 should not be past the critical batch;

every arm but the fixed ones at the user's LR with no sweep: `fixedS`'s best LR (the LR a user tuned at their
starting batch), scaled as the batch grows by the LR rule (`sqrt` for the phases, Seesaw and the late switch,
`--noise-lr-scaling`, `sqrt_gain` by default, for the noise arms). In the `seeds` phase every arm runs seeds 0, 1,
2 interleaved: all arms of seed 0, then of seed 1, ... so that arms compared share the machine's state. The seed
sets the initial weights from scratch and the LoRA adapter's, and in fine-tuning also the order of the samples
(from scratch every arm reads them in one order).

Each run holds the held-out loss at every evaluation (every `--eval-every` samples: samples, steps, training seconds
without evaluation; `EvalClock` of `time_to_loss.py`) and its log (effective batch, LR, noise scale, statistical
efficiency). The summary per setup: the best fixed arm (lowest median final eval loss over the seeds, each fixed arm
at its best LR), its final loss L and its training time T; per arm, the final eval loss over L, the time to L and
to 1.01 L over T, its time over the time the best fixed arm of the same seed took to reach the arm's own final loss
("same loss": the fixed arm's curve reaches 1.01 L before its end too, so below 1 is what says the schedule beat
stopping the fixed arm early), the time to two fixed targets (`--targets`, else the median and the highest of the
fixed arms' final losses in the grid), samples and steps; the issue's goal (final eval loss within 1% of L, reached in at most
0.8 T) met or missed per schedule arm; a plot per setup.

    python benchmarks/time_to_quality.py --prepare-english .venv/lib/python3.11/site-packages --corpus .corpus
    python3 benchmarks/time_to_quality.py --out $OUT --setup lora --phase grid --time-limit 540
    python3 benchmarks/time_to_quality.py --out $OUT --setup lora --phase seeds --best GRID.json --time-limit 540
    python benchmarks/time_to_quality.py --out OUT --summarise GRID.json SEEDS.json    # merge, summarise, plot
                                                   # (a later file's run of an arm, seed and LR replaces an earlier one)
    python benchmarks/time_to_quality.py --out /tmp/ttq --tiny                         # a CPU dry run, every setup

`--time-limit S` starts no arm that would end after S seconds from the start of the call, judged by the longest arm
so far; the JSON (`time_to_quality_SETUP_PHASE.json`) is written after every arm and lists the arms left out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from common import Deadline, EvalClock, device_name, first_at, save, scratch_model, versions
from corpus import source_files, texts

SETUPS = ("scratch", "full", "lora")
GRIDS = {  # the middle one first: a call cut short still holds the likeliest best
    "scratch": (1.5e-3, 7.5e-4, 3e-3),
    "full": (5e-4, 2.5e-4, 1e-3),
    "lora": (2e-3, 1e-3, 4e-3),
}
WITHIN = 0.01  # the goal: final eval loss within 1% of the best fixed arm's ...
TIME_GOAL = 0.8  # ... reached in at most 0.8x that arm's training time
WARMUP_RATIO = 0.02  # of the cosine schedule's steps
LATE_AT, LATE_FACTOR = 0.7, 8  # the late switch: S up to this fraction of the budget, then this many times S
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# --- data ------------------------------------------------------------------------------------------------------------


def metadata_prose(roots: list[str]) -> list[str]:
    """The long descriptions (the body after the headers) of every `METADATA` file under `roots`, sorted by path."""
    bodies = []
    for root in roots:
        for path in sorted(Path(root).rglob("METADATA")):
            text = path.read_text(encoding="utf-8", errors="replace")
            body = text.split("\n\n", 1)[1] if "\n\n" in text else ""
            if len(body) >= 200:
                bodies.append(body)
    return bodies


def english_texts(roots: list[str]) -> list[str]:
    from adaptive_batch.testing import text_corpus

    return text_corpus() + metadata_prose(roots)


def encode(tokenizer, eos: int, documents) -> np.ndarray:
    ids = []
    for text in documents:
        ids.extend(tokenizer.encode(text).ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int64)


def prepare_english(corpus: str, roots: list[str]) -> dict:
    """English text tokenised with `corpus`'s tokenizer, saved as `english.npz` and `english.json` in `corpus`."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(corpus, "tokenizer.json"))
    tokens = encode(tokenizer, tokenizer.token_to_id("<eos>"), english_texts(roots)).astype(np.uint16)
    np.savez_compressed(os.path.join(corpus, "english.npz"), tokens=tokens)
    info = {
        "command": "python benchmarks/time_to_quality.py " + " ".join(sys.argv[1:]),
        "sources": ["pydoc_data.topics"] + [f"{root}/**/METADATA" for root in roots],
        "python": platform.python_version(),
        "tokens": int(len(tokens)),
        "sha256": hashlib.sha256(tokens.tobytes()).hexdigest(),
    }
    save(info, os.path.join(corpus, "english.json"))
    return info


def windows(tokens: np.ndarray, seq_len: int) -> torch.Tensor:
    tokens = torch.from_numpy(tokens.astype(np.int64))
    return tokens[: len(tokens) // seq_len * seq_len].view(-1, seq_len)


def load_corpora(options) -> dict:
    """Corpus A (code) and B (English) as rows of `seq_len` tokens, with the vocabulary and where they came from."""
    if (
        options.tiny
    ):  # a small tokenizer trained on the spot on the standard library's source and the Python docs
        from adaptive_batch.testing import text_corpus, train_tokenizer

        stdlib = os.path.dirname(os.__file__)
        code = list(texts(source_files([os.path.join(stdlib, "email"), os.path.join(stdlib, "json")])))
        english = text_corpus()
        tokenizer = train_tokenizer(code[:40] + english[:1500], vocab_size=512)
        backend, eos = tokenizer.backend_tokenizer, tokenizer.eos_token_id
        code_tokens, english_tokens = encode(backend, eos, code), encode(backend, eos, english)
        vocab = len(tokenizer)
        info = {"code": "stdlib email and json source (tiny)", "english": "pydoc_data.topics (tiny)"}
    else:
        code_tokens = np.load(os.path.join(options.corpus, "tokens.npz"))["tokens"]
        with open(os.path.join(options.corpus, "corpus.json")) as f:
            code_info = json.load(f)
        vocab = code_info["vocab"]
        path = os.path.join(options.corpus, "english.npz")
        if not os.path.exists(path):
            print(f"{path} missing: English from pydoc_data.topics only", flush=True)
            prepare_english(options.corpus, [])
        english_tokens = np.load(path)["tokens"]
        with open(os.path.join(options.corpus, "english.json")) as f:
            info = {"code": code_info, "english": json.load(f)}
    return {
        "code": windows(code_tokens, options.seq_len),
        "english": windows(english_tokens, options.seq_len),
    } | {
        "vocab": vocab,
        "info": info,
    }


def split(rows: torch.Tensor, train_rows: int, eval_rows: int, what: str):
    """The first `train_rows` rows (all but the held-out ones if 0) as training samples, the last `eval_rows` held
    out."""
    available = len(rows) - eval_rows
    train_rows = train_rows or available
    if train_rows > available:
        raise ValueError(f"{what}: {len(rows)} rows, {train_rows} + {eval_rows} needed")
    return [{"input_ids": row, "labels": row} for row in rows[:train_rows]], rows[-eval_rows:]


# --- arms and runs ---------------------------------------------------------------------------------------------------


def fixed_arms(start: int) -> list[str]:
    return [f"fixed{start << k}" for k in range(5)]


def all_arms(start: int, efficiencies: list[float]) -> list[str]:
    return (
        fixed_arms(start)
        + ["phase", "noise"]
        + [f"noise_eff{e:g}" for e in efficiencies]
        + ["seesaw", "late"]
    )


def seesaw_boundaries(doublings: int = 4, warmup: float = WARMUP_RATIO) -> list[float]:
    """Fractions of the budget where a cosine schedule (to 0 after a linear warmup over `warmup` of it) has fallen
    to 1/2, 1/4, ... of its peak: Seesaw's points to double the batch instead.

    Example: without warmup the cosine halves at 0.5, quarters at 2/3, then 0.770 and 0.839.
    """
    return [warmup + (1 - warmup) * math.acos(2.0 ** (1 - k) - 1) / math.pi for k in range(1, doublings + 1)]


def schedule_for(arm: str, start: int, noise_rule: str):
    """(schedule, lr_scaling) of an arm."""
    from adaptive_batch import NoiseScaleSchedule, PhaseSchedule

    if arm.startswith("fixed"):
        return int(arm[len("fixed") :]), "none"
    if arm == "phase":
        return PhaseSchedule([start << k for k in range(5)], boundaries=[1 / 16, 1 / 8, 1 / 4, 1 / 2]), "sqrt"
    if arm == "noise":
        return NoiseScaleSchedule(start, max_size=16 * start, min_efficiency=None), noise_rule
    if arm.startswith("noise_eff"):
        bound = float(arm[len("noise_eff") :])
        return NoiseScaleSchedule(start, max_size=16 * start, min_efficiency=bound), noise_rule
    if arm == "seesaw":
        return PhaseSchedule([start << k for k in range(5)], boundaries=seesaw_boundaries()), "sqrt"
    if arm == "late":
        return PhaseSchedule([start, LATE_FACTOR * start], boundaries=[LATE_AT]), "sqrt"
    raise ValueError(f"unknown arm {arm!r}")


def train_args(
    options, output_dir: str, lr: float, epochs: int, seed: int, data_seed: int, weight_decay: float
):
    from transformers import TrainingArguments

    cuda = torch.cuda.is_available()
    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=options.start,
        num_train_epochs=epochs,
        learning_rate=lr,
        lr_scheduler_type="cosine",
        warmup_steps=WARMUP_RATIO,  # a ratio of the (nominal) steps
        weight_decay=weight_decay,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        bf16=cuda,
        use_cpu=not cuda,
        logging_steps=options.logging_steps,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=seed,
        data_seed=data_seed,
        dataloader_pin_memory=False,
    )


def pretrain_base(data: dict, options) -> dict:
    """The fine-tuning setups' base: `--base-rows` rows of corpus A at a constant batch, seed 0, saved."""
    from transformers import PrinterCallback, Trainer

    from adaptive_batch import AdaptiveBatch

    train, held_out = split(data["code"], options.base_rows, options.eval_rows, "corpus A (base)")
    model = scratch_model(data["vocab"], options.seq_len, options.tiny, 0)
    if torch.cuda.is_available():
        model = model.cuda()
    adaptive = AdaptiveBatch(schedule=options.base_batch)
    clock = EvalClock(held_out, options.base_rows, adaptive)
    args = train_args(options, os.path.join(options.workdir, "base-run"), options.base_lr, 1, 0, 0, 0.1)
    trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[adaptive, clock.callback])
    trainer.remove_callback(PrinterCallback)
    began = time.perf_counter()
    trainer.train()
    path = os.path.join(options.workdir, "base")
    trainer.model.save_pretrained(path)
    digest = hashlib.sha256()
    for tensor in trainer.model.state_dict().values():
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    info = {
        "path": path,
        "rows": options.base_rows,
        "batch": options.base_batch,
        "lr": options.base_lr,
        "seconds": time.perf_counter() - began,
        "code_eval_loss": clock.points[-1]["eval_loss"],
        "weights_sha256": digest.hexdigest(),
    }
    del trainer, model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return info


def make_model(setup: str, seed: int, data: dict, options):
    if setup == "scratch":
        return scratch_model(data["vocab"], options.seq_len, options.tiny, seed)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(os.path.join(options.workdir, "base"), dtype=torch.float32)
    if setup == "lora":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed)  # the adapter's initial weights
        config = LoraConfig(
            r=options.lora_r,
            lora_alpha=2 * options.lora_r,
            lora_dropout=0.0,
            target_modules=LORA_TARGETS,
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, config)
    return model


def run(setup: str, arm: str, lr: float, seed: int, rows: tuple, data: dict, options) -> dict:
    from transformers import PrinterCallback, Trainer

    from adaptive_batch import AdaptiveBatch

    train, held_out = rows
    model = make_model(setup, seed, data, options)
    if torch.cuda.is_available():
        model = model.cuda()
    schedule, rule = schedule_for(arm, options.start, options.noise_lr_scaling)
    adaptive = AdaptiveBatch(schedule=schedule, lr_scaling=rule)
    clock = EvalClock(held_out, options.eval_every or (512 if setup == "scratch" else 256), adaptive)
    args = train_args(
        options,
        os.path.join(options.workdir, f"{setup}-{arm}-{lr:g}-{seed}"),
        lr,
        1 if setup == "scratch" else options.ft_epochs,
        seed,
        0 if setup == "scratch" else seed,  # fine-tuning: the seed also orders the samples
        0.0 if setup == "lora" else 0.1,
    )
    trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[adaptive, clock.callback])
    trainer.remove_callback(PrinterCallback)  # the table is printed at the end; the logs are in the JSON
    began = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - began
    logs = [
        {
            k: v
            for k, v in log.items()
            if k.startswith("adaptive_batch/") or k in ("loss", "learning_rate", "step")
        }
        for log in trainer.state.log_history
        if "loss" in log
    ]
    result = {
        "setup": setup,
        "arm": arm,
        "lr": lr,
        "seed": seed,
        "lr_scaling": rule,
        "wall_seconds": wall,
        "train_seconds": clock.points[-1]["train_seconds"],
        "steps": trainer.state.global_step,
        "samples": clock.points[-1]["samples"],
        "final_eval_loss": clock.points[-1]["eval_loss"],
        "points": clock.points,
        "changes": [dict(c.__dict__) for c in getattr(schedule, "changes", [])],
        "statistical_efficiency": [
            (log["adaptive_batch/samples_seen"], log["adaptive_batch/statistical_efficiency"])
            for log in logs
            if "adaptive_batch/statistical_efficiency" in log
        ],
        "logs": logs,
    }
    del trainer, model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


# --- summary ---------------------------------------------------------------------------------------------------------


def best_lrs(runs: list[dict], arms: list[str]) -> dict:
    """Each fixed arm's LR with the lowest final eval loss on seed 0 (grid runs)."""
    best = {}
    for arm in arms:
        candidates = [r for r in runs if r["arm"] == arm and r["seed"] == 0]
        if candidates:
            best[arm] = min(candidates, key=lambda r: r["final_eval_loss"])["lr"]
    return best


def grid_targets(runs: list[dict], best: dict) -> list[float]:
    """The two fixed targets: the median and the highest final eval loss of the fixed arms at their best LR, seed 0."""
    finals = [r["final_eval_loss"] for r in runs if r["seed"] == 0 and best.get(r["arm"]) == r["lr"]]
    return [statistics.median(finals), max(finals)] if finals else []


def seconds_to(run: dict, loss: float) -> float:
    point = first_at(run["points"], loss)
    return point["train_seconds"] if point else math.inf


def median(values) -> float | None:
    values = list(values)
    if not values:
        return None
    m = statistics.median(values)
    return m if math.isfinite(m) else None


def summarise(runs: list[dict], targets: list[float]) -> dict:
    """The best fixed arm (lowest median final eval loss over seeds), each arm against it, the goals. `runs`: each
    arm at one LR (the fixed arms at their best, the rest at the user's)."""
    arms = list(dict.fromkeys(r["arm"] for r in runs))
    by_arm = {arm: [r for r in runs if r["arm"] == arm] for arm in arms}
    fixed = [a for a in arms if a.startswith("fixed")]
    if not fixed:
        return {}
    best = min(fixed, key=lambda a: statistics.median(r["final_eval_loss"] for r in by_arm[a]))
    loss = statistics.median(r["final_eval_loss"] for r in by_arm[best])
    seconds = statistics.median(r["train_seconds"] for r in by_arm[best])
    best_by_seed = {r["seed"]: r for r in by_arm[best]}
    table, goals = [], []
    for arm in arms:
        group = by_arm[arm]
        # the arm's time over the time the best fixed arm of the same seed took to reach the arm's final loss (None
        # where that fixed run never reached it): below 1, stopping the fixed arm early would not have been as fast
        same_loss = []
        for r in group:
            fixed_seconds = (
                seconds_to(best_by_seed[r["seed"]], r["final_eval_loss"]) if r["seed"] in best_by_seed else 0
            )
            same_loss.append(r["train_seconds"] / fixed_seconds if 0 < fixed_seconds < math.inf else None)
        to_best = [seconds_to(r, loss) for r in group]
        to_within = [seconds_to(r, loss * (1 + WITHIN)) for r in group]
        row = {
            "arm": arm,
            "lr": group[0]["lr"],
            "seeds": sorted(r["seed"] for r in group),
            "final_eval_loss": median(r["final_eval_loss"] for r in group),
            "final_over_best": median(r["final_eval_loss"] / loss for r in group),
            "train_seconds": median(r["train_seconds"] for r in group),
            "time_to_best_over_best": median(t / seconds for t in to_best),
            "time_to_within_1pct_over_best": median(t / seconds for t in to_within),
            "time_to_within_1pct_per_seed": [t / seconds if math.isfinite(t) else None for t in to_within],
            "time_over_best_fixed_at_same_loss": median(x for x in same_loss if x is not None),
            "time_over_best_fixed_at_same_loss_per_seed": same_loss,
            "seconds_to_targets": [median(seconds_to(r, t) for r in group) for t in targets],
            "samples": median(r["samples"] for r in group),
            "steps": median(r["steps"] for r in group),
            "largest_batch": [
                max((log["adaptive_batch/effective_batch_size"] for log in r["logs"]), default=None)
                for r in group
            ],
            "final_statistical_efficiency": [
                r["statistical_efficiency"][-1][1] if r["statistical_efficiency"] else None for r in group
            ],
        }
        table.append(row)
        if not arm.startswith("fixed"):
            final_ok = row["final_over_best"] is not None and row["final_over_best"] <= 1 + WITHIN
            time_ok = row["time_to_within_1pct_over_best"] is not None and (
                row["time_to_within_1pct_over_best"] <= TIME_GOAL
            )
            reached = sum(t is not None and t <= TIME_GOAL for t in row["time_to_within_1pct_per_seed"])
            goals.append(
                f"{arm}: {'MET' if final_ok and time_ok else 'MISSED'} (median final {row['final_over_best'] or 0:.4f}x"
                f" of {best}'s, goal <= {1 + WITHIN}; median time to within 1% {fmt(row['time_to_within_1pct_over_best'])}"
                f"x of its time, goal <= {TIME_GOAL}; {reached}/{len(group)} seeds reached 1.01 L within {TIME_GOAL} T)"
            )
    return {
        "best_fixed_arm": best,
        "best_fixed_final_eval_loss": loss,
        "best_fixed_train_seconds": seconds,
        "targets": targets,
        "table": table,
        "goals": goals,
    }


def fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(setup: str, summary: dict) -> None:
    if not summary:
        print(f"{setup}: no fixed arm run, no summary")
        return
    targets = ", ".join(f"{t:.4f}" for t in summary["targets"])
    print(
        f"\n{setup}: best fixed {summary['best_fixed_arm']}, final loss L = {summary['best_fixed_final_eval_loss']:.4f}"
        f" in T = {summary['best_fixed_train_seconds']:.1f} s; targets {targets}"
    )
    print(
        "arm            LR        seeds  final    /L      t(L)/T  t(1.01L)/T  same loss  s to targets    samples   steps  batch"
    )
    for row in summary["table"]:
        to_targets = "/".join(fmt(t, ".1f") for t in row["seconds_to_targets"])
        batch = "/".join(str(b) for b in row["largest_batch"])
        print(
            f"{row['arm']:14} {row['lr']:<9.3g} {len(row['seeds']):5}  {row['final_eval_loss']:.4f}  "
            f"{row['final_over_best']:.4f}  {fmt(row['time_to_best_over_best']):>6}  "
            f"{fmt(row['time_to_within_1pct_over_best']):>10}  {fmt(row.get('time_over_best_fixed_at_same_loss')):>9}"
            f"  {to_targets:>14}  {row['samples']:>7.0f}  "
            f"{row['steps']:>6.0f}  {batch}"
        )
    for line in summary["goals"]:
        print("  " + line)


def plot(setup: str, runs: list[dict], summary: dict, path: str) -> str | None:
    """Eval loss against training seconds, effective batch and statistical efficiency against samples."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return "matplotlib not importable: no plot"
    figure = Figure(figsize=(15, 4.5))
    FigureCanvasAgg(figure)
    loss_axes, batch_axes, efficiency_axes = figure.subplots(1, 3)
    styles = {}  # ten colours, then the same ten dashed: 11 arms by default
    for r in runs:
        n = styles.setdefault(r["arm"], len(styles))
        style = {"color": f"C{n % 10}", "linestyle": "-" if n < 10 else "--"}
        label = r["arm"] if r["seed"] == min(x["seed"] for x in runs if x["arm"] == r["arm"]) else None
        points = [p for p in r["points"] if p["samples"] > 0]
        loss_axes.plot(
            [p["train_seconds"] for p in points], [p["eval_loss"] for p in points], label=label, **style
        )
        sizes = [
            (log["adaptive_batch/samples_seen"], log["adaptive_batch/effective_batch_size"])
            for log in r["logs"]
        ]
        batch_axes.step([x for x, _ in sizes], [y for _, y in sizes], where="post", label=label, **style)
        if r["statistical_efficiency"]:
            xs, ys = zip(*r["statistical_efficiency"])
            efficiency_axes.plot(xs, ys, label=label, **style)
    if summary:
        loss = summary["best_fixed_final_eval_loss"]
        loss_axes.axhline(
            loss, color="grey", linestyle="--", linewidth=1, label=f"L ({summary['best_fixed_arm']})"
        )
        loss_axes.axhline(loss * (1 + WITHIN), color="grey", linestyle=":", linewidth=1, label="1.01 L")
        finals = [r["final_eval_loss"] for r in runs]
        loss_axes.set_ylim(min(finals) - 0.1, max(finals) + 0.6)
    loss_axes.set(xlabel="training seconds (evaluation excluded)", ylabel="held-out loss", title=setup)
    batch_axes.set(xlabel="samples seen", ylabel="effective batch (logged steps)", yscale="log")
    efficiency_axes.set(xlabel="samples seen", ylabel="modelled statistical efficiency (noise arms)")
    for axes in (loss_axes, batch_axes, efficiency_axes):
        axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    return path


def chosen(runs: list[dict]) -> list[dict]:
    """The seeds phase's runs where there are any (each arm at its LR), else the grid's fixed arms at their best LR."""
    seeds = [r for r in runs if r.get("phase") == "seeds"]
    if seeds:
        return seeds
    best = best_lrs(runs, list(dict.fromkeys(r["arm"] for r in runs)))
    return [r for r in runs if best.get(r["arm"]) == r["lr"]]


def report_setup(setup: str, report: dict, out: str, targets: list[float] | None = None) -> dict:
    runs = chosen([r for r in report["runs"] if r["setup"] == setup])
    targets = targets or report.get("targets") or grid_targets(runs, best_lrs(runs, report["fixed_arms"]))
    summary = summarise(runs, targets)
    report.setdefault("summary", {})[setup] = summary
    report.setdefault("plots", {})[setup] = plot(
        setup, runs, summary, os.path.join(out, f"time_to_quality_{setup}.png")
    )
    return summary


# --- main ------------------------------------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--setup", default="scratch", help="scratch, full or lora (comma list allowed)")
    parser.add_argument("--phase", choices=("grid", "seeds", "both"), default="grid")
    parser.add_argument("--corpus", default=".corpus")
    parser.add_argument(
        "--arms", help="the arms to run (default: every fixed arm in the grid, every arm in seeds)"
    )
    parser.add_argument("--lrs", help="the grid's LRs (default per setup: " + str(GRIDS) + ")")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument(
        "--best", nargs="+", metavar="JSON", help="grid results: the fixed arms' best LRs (seeds)"
    )
    parser.add_argument("--targets", help="two eval losses to time every arm to (default: from the grid)")
    parser.add_argument("--start", type=int, default=16, help="the smallest batch; fixed arms go to 16x it")
    parser.add_argument("--efficiencies", default="0.9,0.95", help="min_efficiency of the noise_eff arms")
    parser.add_argument("--noise-lr-scaling", default="sqrt_gain")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--train-rows", type=int, default=16384, help="scratch: rows of corpus A, one epoch")
    parser.add_argument("--eval-rows", type=int, default=256)
    parser.add_argument(
        "--eval-every", type=int, help="samples between evaluations (512 scratch, 256 fine-tuning)"
    )
    parser.add_argument(
        "--base-rows", type=int, default=16384, help="rows of corpus A the base is pretrained on"
    )
    parser.add_argument("--base-batch", type=int, default=64)
    parser.add_argument("--base-lr", type=float, default=1.5e-3)
    parser.add_argument("--ft-rows", type=int, default=0, help="rows of corpus B to fine-tune on (0: all)")
    parser.add_argument("--ft-epochs", type=int, default=4)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--logging-steps", type=int, default=5)
    parser.add_argument(
        "--time-limit", type=float, default=0, help="start no arm that would end after this (s)"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="a CPU dry run: tiny model and corpora, every setup"
    )
    parser.add_argument(
        "--summarise", nargs="+", metavar="JSON", help="merge these results, summarise and plot"
    )
    parser.add_argument(
        "--prepare-english", nargs="*", metavar="DIR", help="build CORPUS/english.npz and stop"
    )
    parser.add_argument("--workdir", default="/tmp/adaptive-batch-time-to-quality")
    options = parser.parse_args()
    if options.prepare_english is not None:
        print(json.dumps(prepare_english(options.corpus, options.prepare_english)))
        return
    if not options.out:
        parser.error("--out is needed")
    os.makedirs(options.out, exist_ok=True)
    if options.tiny:
        options.start, options.seq_len, options.eval_rows = 4, 64, 32
        options.train_rows, options.base_rows, options.base_batch, options.ft_rows = 256, 256, 16, 256
        options.ft_epochs, options.eval_every, options.logging_steps = 1, 64, 1
        if options.setup == "scratch" and options.phase == "grid" and not options.best:
            options.setup, options.phase, options.seeds = ",".join(SETUPS), "both", "0,1"
    setups = options.setup.split(",")
    efficiencies = [float(e) for e in options.efficiencies.split(",") if e]
    fixed = fixed_arms(options.start)
    if options.summarise:
        report = {"sources": options.summarise, "runs": [], "start": options.start, "fixed_arms": fixed}
        for name in options.summarise:
            with open(name) as f:
                part = json.load(f)
            # a later file's run replaces an earlier one's of the same setup, phase, arm, seed and LR: a seed run
            # again whole in a call of its own replaces the part of it an earlier call ran before its time limit
            key = lambda r: (r["setup"], r["phase"], r["arm"], r["seed"], r["lr"])  # noqa: E731
            replaced = {key(r) for r in part["runs"]}
            report["runs"] = [r for r in report["runs"] if key(r) not in replaced] + part["runs"]
            if part.get("targets"):
                report.setdefault("targets_by_setup", {}).setdefault(part["setup"], part["targets"])
        summarised = list(dict.fromkeys(r["setup"] for r in report["runs"]))
        for setup in summarised:
            targets = [float(t) for t in options.targets.split(",")] if options.targets else None
            targets = targets or report.get("targets_by_setup", {}).get(setup)
            print_table(setup, report_setup(setup, report, options.out, targets))
        save(
            {k: v for k, v in report.items() if k != "runs"},
            os.path.join(options.out, f"time_to_quality_{'_'.join(summarised)}_summary.json"),
        )
        return

    deadline = Deadline(options.time_limit)
    data = load_corpora(options)
    seeds = [int(s) for s in options.seeds.split(",")]
    grid_arms = options.arms.split(",") if options.arms else fixed
    seed_arms = options.arms.split(",") if options.arms else all_arms(options.start, efficiencies)
    best, targets = {}, {}
    if options.best:
        grid_runs = []
        for name in options.best:
            with open(name) as f:
                grid_runs.extend(json.load(f)["runs"])
        for setup in setups:
            setup_runs = [r for r in grid_runs if r["setup"] == setup]
            best[setup] = best_lrs(setup_runs, fixed)
            targets[setup] = grid_targets(setup_runs, best[setup])
    if options.targets:
        targets = {setup: [float(t) for t in options.targets.split(",")] for setup in setups}
    tables = {}
    for setup in setups:
        report = {
            "command": " ".join(sys.argv),
            "device": device_name(),
            "versions": versions(),
            "setup": setup,
            "phase": options.phase,
            "options": vars(options),
            "corpora": data["info"],
            "start": options.start,
            "fixed_arms": fixed,
            "targets": targets.get(setup),
            "runs": [],
            "skipped": [],
        }
        if setup == "scratch":
            rows = split(data["code"], options.train_rows, options.eval_rows, "corpus A")
        else:
            report["base"] = pretrain_base(data, options)
            rows = split(data["english"], options.ft_rows, options.eval_rows, "corpus B")
            print(f"base: {json.dumps({k: v for k, v in report['base'].items() if k != 'weights_sha256'})}")
        report["train_rows"] = len(rows[0])
        path = os.path.join(options.out, f"time_to_quality_{setup}_{options.phase}.json")
        lrs = [float(x) for x in options.lrs.split(",")] if options.lrs else list(GRIDS[setup])
        if options.tiny and not options.lrs:
            lrs = lrs[:2]
        plan = []
        if options.phase in ("grid", "both"):  # every arm at one LR before the next LR
            plan += [("grid", arm, lr, 0) for lr in lrs for arm in grid_arms]
        if options.phase in ("seeds", "both"):
            plan += [("seeds", arm, None, seed) for seed in seeds for arm in seed_arms]
        if torch.cuda.is_available() and not options.tiny:  # CUDA and kernels warmed up, untimed
            run(setup, fixed[2], lrs[0], 0, (rows[0][:512], rows[1]), data, options)
        for phase, arm, lr, seed in plan:
            if lr is None:  # seeds: the fixed arms at their best LR, the rest at the user's (fixedS's best)
                if setup not in best:
                    best[setup] = best_lrs([r for r in report["runs"] if r["phase"] == "grid"], fixed)
                lr = best[setup].get(arm, best[setup].get(fixed[0]))
                if lr is None:
                    raise SystemExit(
                        f"{setup}: no best LR for {arm} (and none for {fixed[0]}): give --best GRID.json"
                    )
            if not deadline.allows_another():
                report["skipped"].append({"phase": phase, "arm": arm, "lr": lr, "seed": seed})
                continue
            result = {"phase": phase, **deadline.run(run, setup, arm, lr, seed, rows, data, options)}
            report["runs"].append(result)
            if phase == "seeds" and not report["targets"]:  # in `both`: the grid just run
                report["targets"] = grid_targets(
                    [r for r in report["runs"] if r["phase"] == "grid"], best.get(setup, {})
                )
            report_setup(setup, report, options.out)
            save(report, path)
            sizes = sorted(
                {log.get("adaptive_batch/effective_batch_size") for log in result["logs"]} - {None}
            )
            print(
                f"{setup:7} {phase:5} {arm:14} lr {lr:<8.3g} seed {seed}: {result['train_seconds']:7.1f} s train, "
                f"{result['steps']:5} steps, final eval {result['final_eval_loss']:.4f}, batches {sizes}",
                flush=True,
            )
        save(report, path)  # again: the arms left out
        if report["skipped"]:
            print(f"{setup}: {len(report['skipped'])} arms left out by --time-limit {options.time_limit:g}")
        if report.get("plots", {}).get(setup):
            print(f"{setup}: plot {report['plots'][setup]}")
        tables[setup] = report.get("summary", {}).get(setup, {})
    for setup, summary in tables.items():  # last, every setup's
        print_table(setup, summary)


if __name__ == "__main__":
    main()
