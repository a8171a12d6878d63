"""A short fine-tune on the CPU with AdaptiveBatch on a batch-size warmup (8 -> 16 -> 32 samples per step).

Everything is offline: the model is a small Llama built from a config (random weights), the text is Python's own
documentation (`pydoc_data.topics`, shipped with CPython), the tokenizer is trained on that text on the spot.
The script is an ordinary TRL SFT script; the AdaptiveBatch line is the only addition.

    python examples/finetune_cpu.py            # trains the whole small model; 15 s on 2 idle cores (2026-12-05)
    python examples/finetune_cpu.py --qlora    # QLoRA: 4-bit NF4 base (bitsandbytes), LoRA, paged 8-bit AdamW
"""

import argparse
import sys
import tempfile

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, PrinterCallback, TrainerCallback
from trl import SFTConfig, SFTTrainer

from adaptive_batch import AdaptiveBatch, PhaseSchedule
from adaptive_batch.testing import text_corpus, tiny_llama, train_tokenizer


class PrintSteps(TrainerCallback):
    """One line per optimizer step: what AdaptiveBatch logged, next to the loss and learning rate."""

    columns = ("step", "epoch", "effective", "micro", "accum", "samples", "tokens", "lr", "loss")

    def on_train_begin(self, args, state, control, **kwargs):
        print(" ".join(f"{c:>9}" for c in self.columns))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" not in logs:
            return
        values = (
            state.global_step,
            f"{logs['epoch']:.2f}",
            logs["adaptive_batch/effective_batch_size"],
            logs["adaptive_batch/micro_batch_size"],
            logs["adaptive_batch/accumulation_steps"],
            logs["adaptive_batch/samples_seen"],
            logs["adaptive_batch/tokens_seen"],
            f"{logs['learning_rate']:.2e}",
            f"{logs['loss']:.3f}",
        )
        print(" ".join(f"{v:>9}" for v in values))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--qlora", action="store_true", help="4-bit NF4 base model (bitsandbytes) with LoRA adapters"
    )
    parser.add_argument("--epochs", type=float, default=2)
    parser.add_argument("--samples", type=int, default=400, help="training samples (paragraphs)")
    options = parser.parse_args()

    texts = text_corpus()
    tokenizer = train_tokenizer(texts[: 4 * options.samples], vocab_size=1024)
    train = Dataset.from_dict({"text": texts[: options.samples]})
    evaluation = Dataset.from_dict({"text": texts[-32:]})

    base = tempfile.mkdtemp(prefix="tiny-llama-")
    tiny_llama(tokenizer, hidden_size=128, num_layers=4).save_pretrained(base)
    quantization = (
        BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
        if options.qlora
        else None
    )
    model = AutoModelForCausalLM.from_pretrained(
        base, quantization_config=quantization, device_map={"": "cpu"}
    )

    args = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="adaptive-batch-example-"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_train_epochs=options.epochs,
        learning_rate=2e-3,
        lr_scheduler_type="cosine",
        warmup_steps=5,
        max_length=96,
        optim="paged_adamw_8bit" if options.qlora else "adamw_torch",
        eval_strategy="epoch",
        save_strategy="no",
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
        if options.qlora
        else None,
        callbacks=[
            # the one line: a batch-size warmup, the learning rate following it by the square-root rule
            adaptive := AdaptiveBatch(
                schedule=PhaseSchedule([8, 16, 32], boundaries=[0.15, 0.4]), lr_scaling="sqrt"
            ),
            PrintSteps(),
        ],
    )
    trainer.remove_callback(PrinterCallback)  # PrintSteps prints one line per step instead of the raw dicts
    trainer.train()
    now = adaptive.current()
    evals = [log for log in trainer.state.log_history if "eval_loss" in log]
    evaluated = ", ".join(f"epoch {log['epoch']:g}: loss {log['eval_loss']:.3f}" for log in evals)
    # one write per line: under a launcher every rank prints to the same pipe, and print()'s separate writes of the
    # parts and the newline interleave with the other rank's
    sys.stdout.write(
        f"micro-batch: {now['micro_batch_size']} (settled: {now['micro_batch_settled_because']})\n"
        f"evaluation: {evaluated}\n"
    )
    sys.stdout.flush()
    # under torchrun / accelerate launch: end the process group before the interpreter does (PyTorch's rule;
    # a gloo group left to interpreter shutdown can abort the process: pytorch/pytorch#190489)
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
