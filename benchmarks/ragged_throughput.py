"""Ragged lengths: real (non-padding) tokens per second of the plain Trainer's ways of batching them and of each
AdaptiveBatch mode, one process, one model, the same effective batch.

The setup is qlora_throughput.py's (Llama-2-7B shape, NF4 QLoRA, LoRA r=16 on q/v, gradient checkpointing,
paged 8-bit AdamW, sdpa attention), with sequences whose lengths follow a stated distribution (`--mix`, see MIXES):
`sft` (default) is lognormal with a median of 200 tokens and sigma 0.8, clipped to [16, 1024] (instructions and chat
turns); `bimodal` is 3 in 4 lognormal around 100 and 1 in 4 around 700, clipped to [16, 2048] (short turns beside long
documents). The histogram is in the JSON. Token ids are random. The user's config is 8 x 8 (effective batch 64).

Arms (`--arms`, in this order by default):
- `random`: the plain Trainer, a padding collator (right padding to the longest row of each batch), random order;
- `grouped`: the same with `train_sampling_strategy="group_by_length"`;
- `flat8`, `flat32`, `flat64`: the plain Trainer with `DataCollatorWithFlattening` (padding-free) at 8 x 8,
  32 x 2 and 64 x 1;
- `auto`: `AdaptiveBatch()` with the padding collator, nothing tuned;
- `tokens16k`, `tokens64k`: `AdaptiveBatch(max_tokens_per_micro_batch=16384 or 65536)`;
- `auto_masked`: `auto` under a Trainer with a `compute_loss` of its own, which keeps the padding mask under sdpa
  (`auto` leaves a causal LM's padding mask out there): the gain of leaving it out, in one call;
- `auto_flat`: `AdaptiveBatch()` with `DataCollatorWithFlattening`;
- `auto_pf`: `AdaptiveBatch(padding_free=True)` with the padding collator (its rows flattened inside the step);
- `auto_torch`: `auto` with the same rows behind a map-style torch `Dataset` (`TorchRows`), which cannot tell its
  lengths before training: AdaptiveBatch reads them from the first collated step. The summary gives its ratio to
  `auto` (`torch_over_list`; the aim: within 5%).
- `fixed`: the ceiling: the plain Trainer at 8 x 2 on rows all FIXED_LENGTH (1,024) tokens long, no padding at all
  (`--fixed-steps` steps); `steady_over_fixed` in the summary is each arm's steady speed over it.

Measured: the wall time of every optimizer step (device synchronised at each step end) and the real tokens each step
trained on (counted in the collator); tokens per second over the steps after the first, and for AdaptiveBatch
also over the steps after its measurements ended ("steady"). The summary compares every arm over the steps after
its first (AdaptiveBatch's measuring steps included, as its user pays them) and gives the steady speed beside (the
files in results/ written before this pooled AdaptiveBatch's steady steps against the plain arms' steps after the
first).

Compilation is counted: every run records the graphs torch.compile built and the recompiles (dynamo's counters),
the steps during which they happened, and its whole-run real tokens/s (the Trainer's train time, first step and
compilation included) beside the steady figure. `--cold` resets dynamo before every timed run, so that each run pays
its own compilation as a user's fresh process does (run it with TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 so no arm
inherits another's kernels from disk); without it a round after the first finds its graphs compiled.

An arm name with the suffix `@nocudnn` (`auto@nocudnn`) runs that arm with torch's cuDNN attention backend turned
off (`torch.backends.cuda.enable_cudnn_sdp(False)` around its training, then restored): torch prefers cuDNN for sdpa
on Hopper (H100, H200) with cuDNN newer than 9.15, and cuDNN builds an attention graph for each new shape, which
ragged micro-batches keep making. Such arms are compared with the arms of the same suffix (their random and
padding-free arms), so that one call measures both backends, interleaved.

`--attention flex_attention` runs every arm with flex attention instead of sdpa: on a padding-free row its block
mask skips the blocks between sequences, where sdpa's packed mask is dense (quadratic in the whole row). It needs a
GPU for training (torch has no flex attention backward on the CPU).

Usage (results go to OUT/ragged_throughput_ATTENTION_MIX.json, written after every arm, and a table at the end):

    python benchmarks/ragged_throughput.py --out OUT            # the H200 run (needs CUDA and bitsandbytes)
    python benchmarks/ragged_throughput.py --out OUT --attention flex_attention --arms random,flat32,flat64,auto_pf
    python benchmarks/ragged_throughput.py --out OUT --arms auto,auto_torch   # torch Dataset vs list
    python benchmarks/ragged_throughput.py --out OUT --tiny     # a CPU dry run of the same code on a tiny model

Arms that run the same micro-batches differed by up to 42% between positions in one run on the H200. The arms run in
`--rounds` rounds (default 2), every other one in reverse order (each arm's mean position the same), and the summary
pools each arm's repeats and says how far apart they were; before its first timed run each arm trains
`--warmup-steps` (default 1) unrecorded steps of its own (see rounds.py), so that no arm runs cold.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from base_model import header, qlora_trainer  # noqa: E402
from qlora_throughput import StepClock, build_model  # noqa: E402
from rounds import WarmUps, add_arguments, interleaved  # noqa: E402

MIXES = {  # name: how its lengths are drawn (see lengths())
    "sft": "lognormal, median 200, sigma 0.8, clipped to [16, 1024]",
    "bimodal": "3 in 4 lognormal median 100 sigma 0.6, 1 in 4 lognormal median 700 sigma 0.35; clipped to [16, 2048]",
}
FIXED_LENGTH = (
    1024  # the `fixed` arm's rows: every row this long, so no padding and no ragged cost (the ceiling)
)
ARMS = {  # name: (per-device, accumulation, collator, AdaptiveBatch arguments or None, extra TrainingArguments)
    "random": (8, 8, "pad", None, {}),
    "grouped": (8, 8, "pad", None, {"train_sampling_strategy": "group_by_length"}),
    "flat8": (8, 8, "flat", None, {}),
    "flat32": (32, 2, "flat", None, {}),
    "flat64": (64, 1, "flat", None, {}),
    "auto": (8, 8, "pad", {}, {}),
    "auto_masked": (8, 8, "pad", {}, {}),  # `auto` with the padding mask kept (a compute_loss of its own)
    "tokens16k": (8, 8, "pad", {"max_tokens_per_micro_batch": 16384}, {}),
    "tokens64k": (8, 8, "pad", {"max_tokens_per_micro_batch": 65536}, {}),
    "auto_flat": (8, 8, "flat", {}, {}),
    "auto_pf": (8, 8, "pad", {"padding_free": True}, {}),
    "auto_padded": (8, 8, "pad", {"padding_free": False}, {}),  # the padded token cut, as stated
    "auto_torch": (8, 8, "pad", {}, {}),
    "rows8": (8, 8, "pad", {"micro_batch_size": 8}, {}),  # padding-free in rows at a fixed micro-batch
    "rows16": (8, 8, "pad", {"micro_batch_size": 16}, {}),
    "rows64": (8, 8, "pad", {"micro_batch_size": 64}, {}),
    "fixed": (8, 2, "pad", None, {}),  # rows of FIXED_LENGTH tokens, micro-batch 8 (8,192 tokens)
}
SUFFIXES = ("", "@nocudnn")  # an arm as listed; the same with sdpa's cuDNN backend off


def split_arm(name: str) -> tuple[str, str]:
    """`("auto", "@nocudnn")` of "auto@nocudnn": the arm of ARMS, and the suffix that says how sdpa runs it."""
    arm, at, suffix = name.partition("@")
    return arm, at + suffix


TORCH_DATASET = {"auto_torch"}  # arms whose rows are served by a torch Dataset instead of a list
MASKED = {"auto_masked"}  # arms whose Trainer has a compute_loss of its own, so that the padding mask stays
TORCH_OVER_LIST_AIM = 0.05  # auto_torch within 5% of auto


def lengths(count: int, mix: str = "sft", seed: int = 0) -> list[int]:
    """`count` row lengths drawn from the mix named `mix` (MIXES), the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn(count, generator=generator, dtype=torch.float64)
    if mix == "sft":
        return torch.exp(math.log(200) + 0.8 * normal).round().clamp(16, 1024).long().tolist()
    long_ = torch.rand(count, generator=generator, dtype=torch.float64) < 0.25
    drawn = torch.where(
        long_, torch.exp(math.log(700) + 0.35 * normal), torch.exp(math.log(100) + 0.6 * normal)
    )
    return drawn.round().clamp(16, 2048).long().tolist()


class Compilations:
    """How many graphs torch.compile built (and how often it recompiled) between `start()` and `stop()`: dynamo's
    process-wide counters, read before and after."""

    def start(self) -> None:
        self.before = self.read()

    def stop(self) -> dict:
        return {key: value - self.before[key] for key, value in self.read().items()}

    @staticmethod
    def read() -> dict:
        from torch._dynamo.utils import counters

        return {
            "graphs_compiled": counters["stats"]["unique_graphs"],
            "recompiles": sum(counters["recompiles"].values()),
        }


class TorchRows(torch.utils.data.Dataset):
    """The same rows behind a map-style torch `Dataset`: `__getitem__` returns the row, so nothing can read the
    lengths before training."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]


class CountingCollator:
    """A collator that records the real tokens of every batch it builds, in order (`calls`)."""

    def __init__(self, kind: str):
        from transformers import DataCollatorWithFlattening

        self.flatten = DataCollatorWithFlattening() if kind == "flat" else None
        self.padding_free = kind == "flat"  # what AdaptiveBatch reads to know the collator flattens
        self.calls: list[int] = []

    def __call__(self, features):
        self.calls.append(sum(len(f["input_ids"]) for f in features))
        if self.flatten is not None:
            return self.flatten(features)
        width = max(len(f["input_ids"]) for f in features)
        ids = torch.zeros(len(features), width, dtype=torch.long)
        mask = torch.zeros(len(features), width, dtype=torch.long)
        for row, feature in enumerate(features):
            n = len(feature["input_ids"])
            ids[row, :n] = torch.tensor(feature["input_ids"])
            mask[row, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class StepTokens:
    """The real tokens each optimizer step trained on (`per_step`), from the batches `collator` built.

    The loop's dataloader reads one batch ahead, so by a step's end the collator has built the next batch too: a
    plain run's steps are its first global_step x `batches_per_step` batches. AdaptiveBatch (`batches_per_step`
    None) collates one batch a step, in the last of its accumulation slots, so with more than one slot the batch
    read ahead is an empty slot, never collated: its steps are every batch built by the step's end."""

    def __init__(self, collator: CountingCollator, batches_per_step: int | None):
        from transformers import TrainerCallback

        totals: list[int] = []
        self.totals = totals

        class Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if batches_per_step is None:
                    assert args.gradient_accumulation_steps > 1, (
                        "the batch read ahead would be the next step's"
                    )
                    built = collator.calls
                else:
                    built = collator.calls[: state.global_step * batches_per_step]
                totals.append(sum(built))

        self.callback = Callback()

    @property
    def per_step(self) -> list[int]:
        return [b - a for a, b in zip([0, *self.totals], self.totals)]


def OwnLoss():  # noqa: N802 - builds a class
    """A Trainer with a `compute_loss` of its own (it only calls the Trainer's): AdaptiveBatch keeps the padding
    mask for it, as for any subclass whose loss may read the mask."""
    from transformers import Trainer

    class OwnLossTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    return OwnLossTrainer


def run_arm(name, model, dataset, steps, tiny, workdir, cold=False):
    """One run of the arm `name`; `cold`: dynamo's caches cleared first, so the run compiles what it needs itself
    (its whole-run figure then includes its compilation; run with TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 so that
    inductor's on-disk caches do not serve one arm what another compiled)."""
    from transformers import TrainerCallback

    from adaptive_batch import AdaptiveBatch

    arm, suffix = split_arm(name)
    per_device, accumulation, kind, adaptive, extra = ARMS[arm]
    clock, collator = StepClock(), CountingCollator(kind)
    graphs = []

    tokens_seen = StepTokens(collator, None if adaptive is not None else accumulation)

    class Graphs(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            graphs.append(Compilations.read()["graphs_compiled"])

    callbacks = [clock.callback, tokens_seen.callback, Graphs()]
    if adaptive is not None:
        callback = AdaptiveBatch(**adaptive)
        callbacks.append(callback)
    trainer = qlora_trainer(
        model,
        TorchRows(dataset) if arm in TORCH_DATASET else dataset,
        callbacks,
        os.path.join(workdir, "trainer"),
        per_device,
        accumulation,
        steps,
        tiny,
        data_collator=collator,
        trainer_class=OwnLoss() if arm in MASKED else None,
        **extra,
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    if cold:
        torch._dynamo.reset()
    compilations = Compilations()
    compilations.start()
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    use_cudnn = cudnn and suffix != "@nocudnn"
    torch.backends.cuda.enable_cudnn_sdp(use_cudnn)
    started = time.perf_counter()
    try:
        trainer.train()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
    train_seconds = time.perf_counter() - started
    seconds = clock.step_seconds
    tokens = tokens_seen.per_step
    logs = [log for log in trainer.state.log_history if "loss" in log]
    result = {
        "arm": name,
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": accumulation,
        "collator": "padding" if kind == "pad" else "DataCollatorWithFlattening",
        "dataset": "torch Dataset" if arm in TORCH_DATASET else "list",
        "sdpa_cudnn": use_cudnn,
        "adaptive_batch": adaptive,
        "training_arguments": extra,
        **step_record(seconds, tokens),
        "cold": cold,
        "train_seconds": train_seconds,
        "whole_run_real_tokens_per_second": sum(tokens) / train_seconds,
        **compilations.stop(),
        "steps_that_compiled": [
            i
            for i, (a, b) in enumerate(zip([compilations.before["graphs_compiled"], *graphs], graphs))
            if b > a
        ],
        "accumulation_steps_per_step": [log.get("adaptive_batch/accumulation_steps") for log in logs],
        "micro_batch_size_per_step": [log.get("adaptive_batch/micro_batch_size") for log in logs],
    }
    if adaptive is not None:
        result.update(settled(callback, seconds, tokens))
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def step_record(seconds: list[float], tokens: list[int]) -> dict:
    """An arm's seconds and real tokens of every step, its real tokens/s over the steps after the first, and the
    device's peak allocated memory."""
    return {
        "step_seconds": seconds,
        "real_tokens_per_step": tokens,
        "real_tokens_per_second": sum(tokens[1:] or tokens) / sum(seconds[1:] or seconds),
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30
        if torch.cuda.is_available()
        else None,
    }


def settled(callback, seconds: list[float], tokens: list[int]) -> dict:
    """AdaptiveBatch's `current()` at the end, and its real tokens/s over the steady steps: those after the last one
    that measured (a timed micro-batch synchronises the device), never the first."""
    now = callback.current()
    measured = now["micro_batch_settled_at_step"]
    if measured is None:  # still measuring at the end
        measured = len(seconds)
    steady = slice(max(measured, 1), None)
    return {
        "current": now,
        "layout": dict(callback.plan_table()).get(
            "layout"
        ),  # padded or padding-free, with the mask or without
        "settled_because": now["micro_batch_settled_because"],
        "first_steady_step": max(measured, 1),
        "real_tokens_per_second_steady": sum(tokens[steady]) / sum(seconds[steady])
        if seconds[steady]
        else None,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="a CPU dry run on a tiny model")
    parser.add_argument(
        "--arms",
        default=",".join(name for name in ARMS if name not in TORCH_DATASET),
        help="comma-separated, from: "
        + ", ".join(ARMS)
        + f" (each also with {SUFFIXES[1]}: sdpa's cuDNN backend off)",
    )
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps of each plain arm")
    parser.add_argument(
        "--adaptive-steps", type=int, default=16, help="optimizer steps of each AdaptiveBatch arm"
    )
    parser.add_argument("--fixed-steps", type=int, default=6, help="optimizer steps of the fixed-length arm")
    parser.add_argument("--workdir", default="/tmp/adaptive-batch-bench")
    add_arguments(parser)
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "flex_attention", "eager"])
    parser.add_argument(
        "--mix",
        default="sft",
        help=f"the length distribution, or several comma-separated: {', '.join(MIXES)}",
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="clear dynamo's caches before every timed run, so that each run's whole-run figure pays its own "
        "compilation (set TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 too)",
    )
    options = parser.parse_args()
    wrong = [
        name
        for name in options.arms.split(",")
        if split_arm(name)[0] not in ARMS or split_arm(name)[1] not in SUFFIXES
    ]
    if wrong:
        parser.error(
            f"--arms {options.arms}: {', '.join(wrong)}: choose from {', '.join(ARMS)}, each with {SUFFIXES[1]} or not"
        )
    unknown = [mix for mix in options.mix.split(",") if mix not in MIXES]
    if unknown:
        parser.error(
            f"--mix {options.mix}: {', '.join(unknown)} is not a mix; choose from {', '.join(MIXES)}"
        )
    os.makedirs(options.out, exist_ok=True)
    os.makedirs(options.workdir, exist_ok=True)

    model, config = build_model(options.tiny, options.workdir)
    if options.attention != "sdpa":
        model.set_attn_implementation(options.attention)
    for mix in options.mix.split(","):  # one model for every mix: loaded (and its attention compiled) once
        run_mix(options, model, config, mix)


def run_mix(options, model, config, mix: str) -> None:
    """Every arm on rows of the length mix `mix`, in rounds; OUT/ragged_throughput_ATTENTION_MIX.json written after
    every arm, and a table at the end."""
    arms = options.arms.split(",")
    count = 64 * max(options.steps, options.adaptive_steps)
    row_lengths = lengths(count, mix)
    generator = torch.Generator().manual_seed(1)
    dataset = [
        {"input_ids": torch.randint(0, config.vocab_size, (n,), generator=generator).tolist()}
        for n in row_lengths
    ]
    fixed = (
        [  # the fixed arm's rows: FIXED_LENGTH random tokens each, as many as its steps need
            {"input_ids": torch.randint(0, config.vocab_size, (FIXED_LENGTH,), generator=generator).tolist()}
            for _ in range(16 * max(options.fixed_steps, options.warmup_steps))
        ]
        if any(split_arm(name)[0] == "fixed" for name in arms)
        else []
    )
    longest = max(row_lengths)
    edges = [16, 64, 128, 256, 512, 768, 1024, 1536, 2048]
    report = {
        **header(options.tiny),
        "attention": options.attention,
        "cold_runs": options.cold,
        "inductor_caches_disabled": os.environ.get("TORCHINDUCTOR_FORCE_DISABLE_CACHES") == "1",
        "cudnn_version": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "sdpa_cudnn_enabled": torch.backends.cuda.cudnn_sdp_enabled(),
        "TORCH_CUDNN_SDPA_DEPRIORITIZED": os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED"),
        "lengths": {
            "mix": mix,
            "distribution": MIXES[mix],
            "rows": count,
            "mean": sum(row_lengths) / count,
            "median": sorted(row_lengths)[count // 2],
            "p99": sorted(row_lengths)[int(count * 0.99)],
            "histogram": {
                f"{low}-{high}": sum(low <= n < high or (n == high == longest) for n in row_lengths)
                for low, high in zip(edges, edges[1:])
                if low < longest
            },
        },
        "fixed_length": FIXED_LENGTH if fixed else None,
        "runs": [],
    }
    # an arm's first training pays for its shapes and kernels (the process's first, for the process's): not its cost
    warm_ups = WarmUps(options.warmup_steps)
    report["warmup"] = warm_ups.record()
    path = os.path.join(options.out, f"ragged_throughput_{options.attention}_{mix}.json")
    for round_, name in interleaved(arms, options.rounds):
        arm = split_arm(name)[0]
        rows = fixed if arm == "fixed" else dataset
        print(f"{time.strftime('%H:%M:%S')} {mix} round {round_}: {name}", flush=True)
        warm_ups.before(name, run_arm, name, model, rows, options.warmup_steps, options.tiny, options.workdir)
        started = time.perf_counter()
        steps = options.adaptive_steps if ARMS[arm][3] is not None else options.steps
        steps = options.fixed_steps if arm == "fixed" else steps
        result = run_arm(name, model, rows, steps, options.tiny, options.workdir, cold=options.cold)
        result["round"] = round_
        report["runs"].append(result)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        print(
            f"{name:>10}: {result['real_tokens_per_second']:,.0f} real tokens/s "
            f"(steady {result.get('real_tokens_per_second_steady') or 0:,.0f}) in "
            f"{time.perf_counter() - started:.0f} s",
            flush=True,
        )
    summarise(report)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print_table(report)


def after_first_part(run) -> tuple[int, float]:
    """Real tokens and seconds of a run's steps after the first (all of a one-step run): the part every arm is
    compared on, AdaptiveBatch's measuring steps included."""
    first = 1 if len(run["step_seconds"]) > 1 else 0
    return sum(run["real_tokens_per_step"][first:]), sum(run["step_seconds"][first:])


def steady_part(run) -> tuple[int, float]:
    """Real tokens and seconds of a run's steps after the first, after the last that compiled a graph and after
    AdaptiveBatch's measuring steps (all but the first where these took every step, as in a short dry run)."""
    compiled = run.get("steps_that_compiled") or [0]
    first = max(run.get("first_steady_step", 1), compiled[-1] + 1)
    if first >= len(run["step_seconds"]):
        first = 1
    return sum(run["real_tokens_per_step"][first:]), sum(run["step_seconds"][first:])


def pool(parts: list[tuple[int, float]]) -> float:
    return sum(t for t, _ in parts) / sum(s for _, s in parts)


def summarise(report):
    """Per arm: its runs pooled (real tokens over seconds of every step after each run's first, the same basis for
    every arm), the ratios to the plain random arm and to the best plain padding-free arm, and how far apart its
    repeats were (the noise floor of the ratios); the torch Dataset's "auto" over the list's. Beside it, for every
    arm: the steady steps (after compiling and AdaptiveBatch's measuring; `steady_over_*` compare steady with steady)
    and the whole run (trainer.train()'s seconds, compilation included; whole with whole)."""
    by_arm: dict[str, list] = {}
    for run in report["runs"]:
        by_arm.setdefault(run["arm"], []).append(run)
    parts = {name: [after_first_part(run) for run in runs] for name, runs in by_arm.items()}
    pooled = {name: pool(own) for name, own in parts.items()}
    whole = {  # every step's tokens over the seconds of trainer.train(), compilation and AdaptiveBatch's search in
        name: sum(sum(run["real_tokens_per_step"]) for run in runs)
        / sum(run["train_seconds"] for run in runs)
        for name, runs in by_arm.items()
    }
    steadies = {name: pool([steady_part(run) for run in runs]) for name, runs in by_arm.items()}

    def peers(speeds: dict, name: str, arm: str | None = None) -> list[float]:
        """The speeds of the arms of `name`'s suffix that are `arm` (or, without one, padding-free plain arms)."""
        suffix = split_arm(name)[1]
        return [
            speed
            for other, speed in speeds.items()
            if split_arm(other)[1] == suffix
            and (split_arm(other)[0] == arm if arm else split_arm(other)[0].startswith("flat"))
        ]

    summary = {
        "random_real_tokens_per_second": pooled.get("random"),
        "fixed_real_tokens_per_second": steadies.get("fixed"),
    }
    if "auto" in pooled and "auto_torch" in pooled:
        ratio = pooled["auto_torch"] / pooled["auto"]
        summary["torch_over_list"] = ratio
        summary["torch_over_list_aim_met"] = abs(ratio - 1) <= TORCH_OVER_LIST_AIM
        steady = {name: pool([steady_part(run) for run in by_arm[name]]) for name in ("auto", "auto_torch")}
        summary["torch_over_list_steady"] = steady["auto_torch"] / steady["auto"]
    for name, speed in pooled.items():
        speeds = [t / s for t, s in parts[name]]
        random_speed = (peers(pooled, name, "random") or [None])[0]  # of this arm's suffix, as below
        fixed_speed = (peers(steadies, name, "fixed") or [None])[0]
        flat, flat_whole, flat_steady = peers(pooled, name), peers(whole, name), peers(steadies, name)
        summary[name] = {
            "real_tokens_per_second": speed,
            "over_random": speed / random_speed if random_speed else None,
            "over_best_plain_flat": speed / max(flat) if flat else None,
            "repeats": len(speeds),
            "spread_between_repeats": max(speeds) / min(speeds) - 1,
            "whole_run_real_tokens_per_second": whole[name],
            "whole_run_over_best_plain_flat": whole[name] / max(flat_whole) if flat_whole else None,
            "graphs_compiled_per_run": [run["graphs_compiled"] for run in by_arm[name]],
        }
        steady = steadies[name]
        summary[name]["real_tokens_per_second_steady"] = steady
        summary[name]["steady_over_best_plain_flat"] = steady / max(flat_steady) if flat_steady else None
        summary[name]["steady_over_fixed"] = steady / fixed_speed if fixed_speed else None
    report["summary"] = summary


def print_table(report):
    print(
        f"\n{report['device']}, {report['model']}, {report['attention']}; lengths {report['lengths']['mix']}: "
        f"{report['lengths']['distribution']}"
    )
    print(
        f"{'round':>5} {'arm':>10} {'pair':>6} {'real tok/s':>11} {'steady':>8} {'peak GiB':>9} {'cut by':>7}"
    )
    for run in report["runs"]:
        steady = run.get("real_tokens_per_second_steady")
        peak = f"{run['peak_allocated_gib']:.1f}" if run["peak_allocated_gib"] else "-"
        cut_by = run["current"]["cut_by"] if "current" in run else "-"  # AdaptiveBatch's unit at the end
        print(
            f"{run.get('round', 0):>5} {run['arm']:>10} "
            f"{run['per_device_train_batch_size']}x{run['gradient_accumulation_steps']:<3} "
            f"{run['real_tokens_per_second']:>11,.0f} {steady or 0:>8,.0f} {peak:>9} {cut_by:>7}"
        )
    summary = report.get("summary", {})
    print(
        "(real tok/s over the steps after each run's first; steady: after compiling and AdaptiveBatch's measuring)"
    )
    print(
        f"\n{'pooled':>10} {'real tok/s':>11} {'x random':>9} {'x flat':>7} {'repeats apart':>14} {'steady':>8} "
        f"{'st x flat':>9} {'st x fixed':>10} {'whole':>7} {'wh x flat':>9} {'graphs':>8}"
    )

    def ratio(value, width: int) -> str:  # "-" where the call ran no arm to compare with
        return f"{value:>{width}.2f}" if value is not None else f"{'-':>{width}}"

    for name, row in summary.items():
        if isinstance(row, dict):
            steady = row.get("real_tokens_per_second_steady")
            print(
                f"{name:>10} {row['real_tokens_per_second']:>11,.0f} {ratio(row['over_random'], 9)} "
                f"{ratio(row['over_best_plain_flat'], 7)} {row['spread_between_repeats']:>14.1%} "
                f"{f'{steady:,.0f}' if steady else '-':>8} {ratio(row['steady_over_best_plain_flat'], 9)} "
                f"{ratio(row['steady_over_fixed'], 10)} {row['whole_run_real_tokens_per_second']:>7,.0f} "
                f"{ratio(row['whole_run_over_best_plain_flat'], 9)} "
                f"{','.join(map(str, row['graphs_compiled_per_run'])):>8}"
            )
    if "torch_over_list" in summary:
        met = "met" if summary["torch_over_list_aim_met"] else "missed"
        apart = max(summary[name]["spread_between_repeats"] for name in ("auto", "auto_torch"))
        print(
            f"auto_torch / auto: {summary['torch_over_list']:.2f} (aim: within {TORCH_OVER_LIST_AIM:.0%}: {met}; "
            f"the runs of one arm up to {apart:.0%} apart); over the steady steps only "
            f"{summary['torch_over_list_steady']:.2f}"
        )


if __name__ == "__main__":
    main()
