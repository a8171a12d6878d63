"""The max_steps trap, and the way out: a bigger batch with the same `max_steps` trains on that many times the data.

A QLoRA run at batch 1 with `max_steps=1000` sees 1,000 samples in 4 hours; the same script at batch 128 "to use the
GPU better" sees 128,000 samples, and takes 40 hours instead of less. With AdaptiveBatch the batch is a schedule
that starts at the user's batch, and the budget is `max_steps` x that starting batch, counted in samples: the batch
grows to 128, the steps get fewer, the data stays 1,000 samples. And where a config does ask for 128 x `max_steps`
samples, the plan printed before any compute says so.

Four runs, offline on the CPU (a small Llama built from a config learns Python's own documentation):

1. the plain Trainer at batch 1, `max_steps=N`;
2. the plain Trainer at batch 128, `max_steps=N`: the trap;
3. batch 1, `max_steps=N` and `AdaptiveBatch(schedule=PhaseSchedule([1, 8, 32, 128], ...))`: the way out;
4. AdaptiveBatch on run 2's config: its plan only, printed before any compute.

    python examples/max_steps_trap.py                     # max_steps=400
    python examples/max_steps_trap.py --max-steps 20      # the smallest run (the test suite's)
    python examples/max_steps_trap.py --model ~/models/SmolLM2-135M   # a local model folder (on a GPU if any)
"""

import argparse
import tempfile
import time

import torch
from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

from adaptive_batch import AdaptiveBatch, PhaseSchedule
from adaptive_batch.testing import example_model, text_corpus, token_dataset

BIG = 128


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=400, help="max_steps, the same in every run")
    parser.add_argument("--model", help="a local model folder instead of the small random Llama")
    options = parser.parse_args()
    steps = options.max_steps

    texts = text_corpus()
    tokenizer, make_model = example_model(options.model, texts)
    rows = token_dataset(tokenizer, texts, max_length=32)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)

    def trainer(batch: int, callbacks=()) -> Trainer:
        return Trainer(
            model=make_model(),
            args=TrainingArguments(
                output_dir=tempfile.mkdtemp(prefix="adaptive-batch-trap-"),
                per_device_train_batch_size=batch,
                max_steps=steps,
                learning_rate=1e-3,
                logging_steps=10,
                save_strategy="no",
                report_to=[],
                use_cpu=not torch.cuda.is_available(),
                disable_tqdm=True,
                seed=0,
            ),
            train_dataset=rows,
            data_collator=collator,
            callbacks=list(callbacks),
        )

    def run(name: str, batch: int, callbacks=()) -> tuple[str, int, int, float]:
        trained = trainer(batch, callbacks)
        start = time.perf_counter()
        trained.train()
        seconds = time.perf_counter() - start
        samples = (
            callbacks[0].current()["samples_seen"] if callbacks else trained.state.global_step * batch
        )  # the plain Trainer: every step takes `batch` samples
        return name, trained.state.global_step, samples, seconds

    results = [
        run(f"plain Trainer, batch 1, max_steps={steps}", 1),
        run(f"plain Trainer, batch {BIG}, max_steps={steps} (the trap)", BIG),
    ]
    growing = AdaptiveBatch(
        # the batch of 1 for the first 5% of the samples, then 8, 32 and 128; LR x sqrt(B / 1)
        schedule=PhaseSchedule([1, 8, 32, BIG], boundaries=[0.05, 0.2, 0.5]),
        lr_scaling="sqrt",
    )
    results.append(run(f"AdaptiveBatch, batch 1 growing to {BIG}, max_steps={steps}", 1, [growing]))

    print(f"\n{'run':62} {'steps':>6} {'samples':>8} {'seconds':>8}")
    for name, done, samples, seconds in results:
        print(f"{name:62} {done:>6} {samples:>8,} {seconds:>8.1f}")
    (_, _, one, one_seconds), (_, _, big, big_seconds), (_, growing_steps, grown, _) = results
    print(
        f"\nThe trap: batch {BIG} with the same max_steps took {big // one}x the samples and "
        f"{big_seconds / one_seconds:.1f}x the time of batch 1."
    )
    # the most samples a step held (a phase the budget ends in may hold only its rest)
    before = growing.plan.samples_before_step
    largest = max(after - at for at, after in zip(before, before[1:]))
    print(
        f"The way out: the batch grew (its largest step held {largest} samples) in {growing_steps} steps and the data "
        f"stayed {grown:,} samples "
        f"(max_steps={steps} x the starting batch of 1)."
    )

    checked = AdaptiveBatch()
    trainer(BIG, [checked])  # built, not trained: the plan is made before any compute
    print("\nAdaptiveBatch on the trap's config prints, before any compute:")
    for label, value in checked.plan_table():
        if label in ("optimizer steps", "samples"):
            print(f"  {label:16} {value}")


if __name__ == "__main__":
    main()
