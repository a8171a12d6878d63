"""The model the GPU benchmarks train: a Llama-2-7B shape with random weights (speed and memory do not depend on
the values), created in bf16 on the GPU and saved, so that each benchmark loads it as a user's run would; and the
Trainer of the classic QLoRA recipe they all train it with; and the header every report starts with."""

from __future__ import annotations

import gc
import json
import os
import platform
import sys

import torch

LLAMA2_7B = dict(
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=32000,
    max_position_embeddings=4096,
)

TINY = dict(  # the same code on the CPU: a dry run of a benchmark
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=512,
    max_position_embeddings=4096,
)


def save_random_llama(path: str, shape: dict = LLAMA2_7B, on_gpu: bool = True) -> str:
    """Create a random `LlamaForCausalLM` of `shape` (bf16 on the GPU, float32 on the CPU) and save it at `path`; one
    already saved there with the same shape and dtype (an earlier call on a warm machine) is kept."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, use_cache=False)
    stamp = os.path.join(path, "random_llama.json")
    wanted = json.dumps({"shape": shape, "on_gpu": on_gpu}, sort_keys=True)
    if os.path.exists(stamp) and open(stamp).read() == wanted:
        return os.fspath(path)
    torch.manual_seed(0)
    if on_gpu:
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda"):
                model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(torch.float32)
    else:
        model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    with open(stamp, "w") as file:
        file.write(wanted)
    del model
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
    return os.fspath(path)


def qlora_arguments(output_dir: str, per_device: int, accumulation: int, steps: int, tiny: bool) -> dict:
    """The TrainingArguments of the classic QLoRA recipe (paged 8-bit AdamW, bf16, gradient checkpointing, a constant
    LR), as keywords, for `TrainingArguments` or TRL's `SFTConfig`; `tiny` runs the same on the CPU."""
    return dict(
        output_dir=output_dir,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        max_steps=steps,
        learning_rate=2e-4,
        lr_scheduler_type="constant",
        optim="adamw_torch" if tiny else "paged_adamw_8bit",
        bf16=not tiny,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        use_cpu=tiny,
        seed=0,
    )


def qlora_trainer(
    model,
    dataset,
    callbacks,
    output_dir,
    per_device,
    accumulation,
    steps,
    tiny,
    data_collator=None,
    trainer_class=None,
    **extra,
):
    """The plain Trainer as a QLoRA script sets it up (paged 8-bit AdamW, bf16, gradient checkpointing, a constant
    LR); `tiny` runs the same code on the CPU. `data_collator`: the default one if `None`; `trainer_class`: a
    subclass of the Trainer to build instead; `extra`: more TrainingArguments."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    args = TrainingArguments(**qlora_arguments(output_dir, per_device, accumulation, steps, tiny), **extra)
    return (trainer_class or Trainer)(
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=data_collator or default_data_collator,
        callbacks=callbacks,
    )


def header(tiny: bool, packages: tuple[str, ...] = ()) -> dict:
    """What every report starts with: the command, the device, the versions (with those of `packages`)."""
    import importlib

    import transformers

    import adaptive_batch

    return {
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else platform.processor() or "cpu",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "adaptive_batch": adaptive_batch.__version__,
            "python": platform.python_version(),
            **{name: importlib.import_module(name).__version__ for name in packages},
        },
        "model": "tiny" if tiny else "Llama-2-7B shape, NF4 double-quant, bf16 compute, LoRA r=16 q/v",
    }
