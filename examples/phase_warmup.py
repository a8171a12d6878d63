"""A batch-size warmup, 8 -> 16 -> 32 samples a step, with the learning rate following by the square-root rule.

The plan is printed before any compute (steps, samples, the LR multiplier of each phase), then one line per phase
after training: the steps it ran, the samples it took and the learning rate it started at. Offline on the CPU: a
small Llama built from a config (random weights) learns Python's own documentation (`pydoc_data.topics`) with a
tokenizer trained on it on the spot.

    python examples/phase_warmup.py                          # 320 samples, 2 epochs
    python examples/phase_warmup.py --samples 48 --epochs 1  # the smallest run (the test suite's)
    python examples/phase_warmup.py --model ~/models/SmolLM2-135M  # a local model folder (on a GPU if there is one)
"""

import argparse
import tempfile

import torch
from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

from adaptive_batch import AdaptiveBatch, PhaseSchedule
from adaptive_batch.testing import example_model, text_corpus, token_dataset


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=320, help="training samples (paragraphs)")
    parser.add_argument("--epochs", type=float, default=2)
    parser.add_argument("--model", help="a local model folder instead of the small random Llama")
    options = parser.parse_args()

    texts = text_corpus()
    tokenizer, make_model = example_model(options.model, texts)
    rows = token_dataset(tokenizer, texts[: options.samples], max_length=64)
    adaptive = AdaptiveBatch(
        # 8 samples a step for the first 10% of the samples, 16 until 30%, then 32
        schedule=PhaseSchedule([8, 16, 32], boundaries=[0.1, 0.3]),
        lr_scaling="sqrt",  # LR x sqrt(B / 8): the rule for Adam-family optimizers
    )
    trainer = Trainer(
        model=make_model(),
        args=TrainingArguments(
            output_dir=tempfile.mkdtemp(prefix="adaptive-batch-warmup-"),
            per_device_train_batch_size=8,
            num_train_epochs=options.epochs,
            learning_rate=2e-3,
            lr_scheduler_type="cosine",
            warmup_steps=0.05,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=not torch.cuda.is_available(),
            disable_tqdm=True,
            seed=0,
        ),
        train_dataset=rows,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        callbacks=[adaptive],
    )

    print("The plan, before any compute:")
    for label, value in adaptive.plan_table():
        print(f"  {label:32} {value}")

    trainer.train()

    print("\nWhat each phase ran:")
    print(f"  {'batch':>5} {'steps':>5} {'samples':>7} {'first LR':>9} {'last loss':>9}")
    logs = [log for log in trainer.state.log_history if "loss" in log]
    seen = 0
    for size in dict.fromkeys(log["adaptive_batch/effective_batch_size"] for log in logs):
        # (an epoch's short last step logs its own size: it shows as a row of its own)
        phase = [log for log in logs if log["adaptive_batch/effective_batch_size"] == size]
        samples = phase[-1]["adaptive_batch/samples_seen"] - seen
        seen = phase[-1]["adaptive_batch/samples_seen"]
        print(
            f"  {size:>5} {len(phase):>5} {samples:>7} {phase[0]['learning_rate']:>9.2e} {phase[-1]['loss']:>9.3f}"
        )
    now = adaptive.current()
    print(
        f"\n{now['samples_seen']} samples in {now['step']} optimizer steps; micro-batch {now['micro_batch_size']}."
    )


if __name__ == "__main__":
    main()
