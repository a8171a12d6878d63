"""TRL's packing: the plain SFTTrainer at every per-device x accumulation pair of one effective batch against
`AdaptiveBatch()` from the user's 1 x 16 and 8 x 2, arms interleaved in one process.

The setup is qlora_throughput.py's (Llama-2-7B shape with random weights, NF4 QLoRA, LoRA r=16 on q/v, gradient
checkpointing, paged 8-bit AdamW, sdpa attention) under TRL's SFTTrainer with `packing=True` and its default
strategy, "bfd": the examples are packed into rows of at most `max_length` (2,048) tokens, and TRL's collator
flattens each batch of such rows into one padding-free row of sequences (`position_ids` restarting at each). The
examples are SFT-like: lengths from ragged_throughput.py's chat-turn distribution (lognormal, median 200, clipped to
[16, 1,024]) with a share of long documents (log-uniform over [512, 2,048]); token ids are random. Every arm trains
the same packed rows (one seeded order), effective batch 16 packed rows.

Arms (`--arms`, in this order by default, in `--rounds` rounds (default 2), every other one in reverse order; each
arm trains `--warmup-steps` (default 1) unrecorded steps of its own before its first timed run, see rounds.py):
- `plain_2x8`, `plain_4x4`, `plain_16x1`, `plain_1x16`, `plain_8x2`: the plain SFTTrainer at that pair;
- `auto_1x16`, `auto_8x2`: the same with `callbacks=[AdaptiveBatch()]` from the user's 1 x 16 or 8 x 2.

Measured per arm: the wall time of every optimizer step (device synchronised at each step end), the real tokens of
each step (TRL's `num_tokens`: with packing every token is real), the forwards of the model in each step, peak
memory, and for AdaptiveBatch `current()` at the end. Real tokens/s over every step after each run's first, the
same basis for every arm (AdaptiveBatch's search included, as its user pays it), each arm's repeats pooled; for
AdaptiveBatch also over its steady steps, from `current()["micro_batch_settled_at_step"]` on (the files in results/
written before this compared those steady steps with the plain arms' steps after the first). Aims, reported as met
or missed: each AdaptiveBatch arm at least 1.0x the plain arm of its own pair, and at least 0.98x the best plain
pair.

Usage (results go to OUT/packing_throughput.json, written after every arm, and a table at the end):

    python3 benchmarks/packing_throughput.py --out $OUT --steps 4 --adaptive-steps 8 --time-limit 480
    python benchmarks/packing_throughput.py --out /tmp/out --tiny     # a CPU dry run of the same code on a tiny model

`--time-limit S` starts no arm that would end after S seconds (judged by the longest arm so far; its warm-up not
counted), so that a call under a time limit still ends with its summary; the arms left out are listed in the JSON.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
from base_model import header, qlora_arguments
from common import Deadline, StepClock, build_model, increments, logged, save, train
from ragged_throughput import after_first_part, lengths, pool, settled, steady_part, step_record
from rounds import WarmUps, add_arguments, interleaved

EFFECTIVE = 16
ARMS = {  # name: (per-device, accumulation, AdaptiveBatch or not)
    "plain_2x8": (2, 8, False),
    "plain_4x4": (4, 4, False),
    "plain_16x1": (16, 1, False),
    "plain_1x16": (1, 16, False),
    "auto_1x16": (1, 16, True),
    "auto_8x2": (8, 2, True),
    "plain_8x2": (8, 2, False),
}
OVER_OWN_PAIR_AIM, OVER_BEST_AIM = 1.0, 0.98
DOCUMENT_SHARE = 0.1  # examples that are long documents rather than chat turns
REFERENCE_LENGTH = 2048  # the lengths below are for this max_length; --max-length scales them


def sft_lengths(count: int, max_length: int, seed: int = 0) -> list[int]:
    """Example lengths: chat turns (ragged_throughput's lognormal) and a `DOCUMENT_SHARE` of long documents
    (log-uniform over [max_length / 4, max_length]), scaled from 2,048 to `max_length`."""
    generator = torch.Generator().manual_seed(seed + 1)
    scale = max_length / REFERENCE_LENGTH
    chat = torch.tensor(lengths(count, seed), dtype=torch.float64) * scale
    documents = torch.exp(
        math.log(max_length / 4) + math.log(4) * torch.rand(count, generator=generator, dtype=torch.float64)
    )
    is_document = torch.rand(count, generator=generator) < DOCUMENT_SHARE
    return torch.where(is_document, documents, chat).round().clamp(2, max_length).long().tolist()


def placeholder_tokenizer():
    """SFTTrainer wants a tokenizer (for the pad token); the examples are token ids already."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
        pad_token="<pad>",
        eos_token="<eos>",
    )


def run_arm(name, model, dataset, tokenizer, steps, options):
    from trl import SFTConfig, SFTTrainer

    from adaptive_batch import AdaptiveBatch
    from adaptive_batch.runtime.memory import release_memory

    per_device, accumulation, adaptive = ARMS[name]
    clock = StepClock()
    callbacks = [clock.callback]
    callback = AdaptiveBatch() if adaptive else None
    if callback is not None:
        callbacks.append(callback)
    args = SFTConfig(  # the QLoRA recipe of base_model.qlora_trainer, under SFTTrainer's packing
        **qlora_arguments(
            os.path.join(options.workdir, "trainer"), per_device, accumulation, steps, options.tiny
        ),
        packing=True,
        max_length=options.max_length,
    )
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=callbacks
    )
    forwards = train(trainer)
    seconds = clock.step_seconds
    tokens = increments(
        logged(trainer, "num_tokens")
    )  # TRL's count of tokens trained on (all real: padding-free)
    result = {
        "arm": name,
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": accumulation,
        "adaptive_batch": adaptive,
        "packed_rows": len(trainer.train_dataset),
        **step_record(seconds, tokens),
        "forwards_per_step": forwards,
        "micro_batch_size_per_step": logged(trainer, "adaptive_batch/micro_batch_size"),
        "accumulation_steps_per_step": logged(trainer, "adaptive_batch/accumulation_steps"),
        "losses": logged(trainer, "loss"),
    }
    if callback is not None:
        result.update(settled(callback, seconds, tokens))
    del trainer
    release_memory(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="a CPU dry run on a tiny model")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated, from: " + ", ".join(ARMS))
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps of each plain arm")
    parser.add_argument(
        "--adaptive-steps", type=int, default=8, help="optimizer steps of each AdaptiveBatch arm"
    )
    add_arguments(parser)
    parser.add_argument(
        "--max-length", type=int, help="tokens per packed row (default 2048; 128 with --tiny)"
    )
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "flex_attention", "eager"])
    parser.add_argument(
        "--time-limit", type=float, default=0, help="start no arm that would end after this (s)"
    )
    parser.add_argument("--workdir", default="/tmp/adaptive-batch-bench")
    options = parser.parse_args()
    options.max_length = options.max_length or (128 if options.tiny else REFERENCE_LENGTH)
    os.makedirs(options.out, exist_ok=True)
    os.makedirs(options.workdir, exist_ok=True)
    deadline = Deadline(options.time_limit)
    import trl  # noqa: F401 - before the model is built: a missing wheel fails the call at once
    from datasets import Dataset

    model, config = build_model(options.tiny, options.workdir)
    if options.attention != "sdpa":
        model.set_attn_implementation(options.attention)
    arms = options.arms.split(",")
    # enough examples for the longest arm's packed rows (bfd fills rows to ~97%), and a margin
    needed = (
        1.15
        * EFFECTIVE
        * max(options.steps, options.adaptive_steps, options.warmup_steps)
        * options.max_length
    )
    pool = sft_lengths(int(needed / 2) + 1, options.max_length)  # (no example is shorter than 2 tokens)
    count = next(i + 1 for i, total in enumerate(torch.tensor(pool).cumsum(0).tolist()) if total >= needed)
    example_lengths = pool[:count]
    generator = torch.Generator().manual_seed(1)
    dataset = Dataset.from_dict(
        {
            "input_ids": [
                torch.randint(2, config.vocab_size, (n,), generator=generator).tolist()
                for n in example_lengths
            ]
        }
    )
    tokenizer = placeholder_tokenizer()
    report = {
        **header(options.tiny, ("trl", "peft", "datasets")),
        "attention": options.attention,
        "max_length": options.max_length,
        "effective_batch": EFFECTIVE,
        "examples": {
            "lengths": f"chat turns: lognormal, median 200, sigma 0.8, clipped to [16, 1024]; {DOCUMENT_SHARE:.0%} "
            f"documents: log-uniform over [512, 2048]; scaled by {options.max_length}/{REFERENCE_LENGTH}",
            "count": count,
            "tokens": sum(example_lengths),
            "mean": sum(example_lengths) / count,
            "longer_than_a_quarter_row": sum(n > options.max_length / 4 for n in example_lengths),
        },
        "runs": [],
        "not_run": [],
    }
    # an arm's first training pays for its shapes and kernels (the process's first, for the process's): not its cost
    warm_ups = WarmUps(options.warmup_steps)
    report["warmup"] = warm_ups.record()
    path = os.path.join(options.out, "packing_throughput.json")
    for round_, name in interleaved(arms, options.rounds):
        if not deadline.allows_another():
            report["not_run"].append({"round": round_, "arm": name})
            continue
        warm_ups.before(name, run_arm, name, model, dataset, tokenizer, options.warmup_steps, options)
        steps = options.adaptive_steps if ARMS[name][2] else options.steps
        result = {"round": round_, **deadline.run(run_arm, name, model, dataset, tokenizer, steps, options)}
        report["runs"].append(result)
        report["summary"] = summarise(report["runs"])
        save(report, path)
        print(
            f"{name:>10}: {result['real_tokens_per_second']:,.0f} real tokens/s "
            f"(steady {result.get('real_tokens_per_second_steady') or 0:,.0f}), forwards {result['forwards_per_step']} "
            f"in {result['seconds']:.0f} s",
            flush=True,
        )
    save(report, path)
    print_table(report)


def summarise(runs: list[dict]) -> dict:
    """Per arm its repeats pooled (real tokens over seconds of every step after each run's first) and how far apart
    they were, AdaptiveBatch's steady speed beside; the best plain pair; each AdaptiveBatch arm's ratios to the plain
    arm of its pair and to the best pair, on the same basis, with the aims met or missed."""
    by_arm: dict[str, list] = {}
    for run in runs:
        by_arm.setdefault(run["arm"], []).append(run)
    arms = {}
    for name, own in by_arm.items():
        parts = [after_first_part(run) for run in own]
        speeds = [t / s for t, s in parts]
        steady_forwards = [
            f for run in own for f in run["forwards_per_step"][run.get("first_steady_step", 1) :]
        ]
        arms[name] = {
            "real_tokens_per_second": pool(parts),
            "repeats": len(own),
            "spread_between_repeats": max(speeds) / min(speeds) - 1,
            "forwards_per_steady_step": sorted(set(steady_forwards)),
        }
        if ARMS[name][2]:
            arms[name]["real_tokens_per_second_steady"] = pool([steady_part(run) for run in own])
    plain = {name: arm for name, arm in arms.items() if not ARMS[name][2]}
    best = max(plain, key=lambda name: plain[name]["real_tokens_per_second"]) if plain else None
    summary = {"arms": arms, "best_plain": best, "adaptive": {}}
    for name, arm in arms.items():
        if not ARMS[name][2]:
            continue
        twin = "plain_" + name.split("_", 1)[1]
        speed = arm["real_tokens_per_second"]
        over_own = speed / arms[twin]["real_tokens_per_second"] if twin in arms else None
        over_best = speed / plain[best]["real_tokens_per_second"] if best else None
        summary["adaptive"][name] = {
            "over_own_pair": over_own,
            "over_own_pair_aim": OVER_OWN_PAIR_AIM,
            "over_own_pair_met": None if over_own is None else over_own >= OVER_OWN_PAIR_AIM,
            "over_best_plain": over_best,
            "over_best_plain_aim": OVER_BEST_AIM,
            "over_best_plain_met": None if over_best is None else over_best >= OVER_BEST_AIM,
            "settled_micro_batch_sizes": [run["current"]["micro_batch_size"] for run in by_arm[name]],
            "settled_because": [run["settled_because"] for run in by_arm[name]],
        }
    return summary


def verdict(met: bool | None) -> str:
    return {True: "met", False: "MISSED", None: "not measured"}[met]


def print_table(report: dict) -> None:
    print(
        f"\n{report['device']}, {report['model']}, {report['attention']}, packing bfd, max_length "
        f"{report['max_length']}, effective batch {report['effective_batch']} packed rows"
    )
    print(
        f"{'round':>5} {'arm':>10} {'micro-batches (rows)':>20} {'fwd/step':>9} {'real tok/s':>11} {'steady':>8} "
        f"{'peak GiB':>9}"
    )
    for run in report["runs"]:
        sizes = [m for m in run["micro_batch_size_per_step"] if m] or [run["per_device_train_batch_size"]]
        first = run.get("first_steady_step", 1)
        peak = f"{run['peak_allocated_gib']:.1f}" if run["peak_allocated_gib"] else "-"
        tokens, seconds = after_first_part(run)
        steady = run.get("real_tokens_per_second_steady")
        print(
            f"{run['round']:>5} {run['arm']:>10} {'-'.join(map(str, sizes)):>20} "
            f"{'/'.join(map(str, sorted(set(run['forwards_per_step'][first:])))):>9} "
            f"{tokens / seconds:>11,.0f} {f'{steady:,.0f}' if steady else '-':>8} {peak:>9}"
        )
    summary = report.get("summary")
    if not summary:
        return
    print(
        "(real tok/s over the steps after each run's first; steady: AdaptiveBatch's steps after it settled)"
    )
    print(f"\n{'pooled':>10} {'real tok/s':>11} {'repeats apart':>14} {'steady':>8}")
    for name, arm in summary["arms"].items():
        best = "  (best plain pair)" if name == summary["best_plain"] else ""
        steady = arm.get("real_tokens_per_second_steady")
        print(
            f"{name:>10} {arm['real_tokens_per_second']:>11,.0f} {arm['spread_between_repeats']:>14.1%} "
            f"{f'{steady:,.0f}' if steady else '-':>8}{best}"
        )
    for name, row in summary["adaptive"].items():
        own = f"{row['over_own_pair']:.3f}" if row["over_own_pair"] is not None else "-"
        best = f"{row['over_best_plain']:.3f}" if row["over_best_plain"] is not None else "-"
        print(
            f"{name}: x{own} its own pair (aim >= {OVER_OWN_PAIR_AIM}: {verdict(row['over_own_pair_met'])}), "
            f"x{best} the best plain pair {summary['best_plain']} (aim >= {OVER_BEST_AIM}: "
            f"{verdict(row['over_best_plain_met'])}); settled at {row['settled_micro_batch_sizes']}"
        )
    if report["not_run"]:
        left = ", ".join(f"{arm['arm']} (round {arm['round']})" for arm in report["not_run"])
        print(f"not run (time limit): {left}")


if __name__ == "__main__":
    main()
