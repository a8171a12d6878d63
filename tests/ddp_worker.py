"""Run by test_ddp.py, under torchrun (2 ranks, gloo) or alone: a short run whose results the test compares.

usage: ddp_worker.py OUTPUT_DIR {trainer,sft} MICRO_BATCH_SIZE [FAKE_OOM_RANK]
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))


def main(output_dir: str, kind: str, micro: str, fake_oom_rank: str | None = None) -> None:
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from adaptive_batch import AdaptiveBatch, PhaseSchedule
    from adaptive_batch.testing import (
        FakeOutOfMemory,
        text_corpus,
        tiny_llama,
        token_dataset,
        train_tokenizer,
    )

    texts = text_corpus()
    tokenizer = train_tokenizer(texts[:1500], vocab_size=384)
    model = tiny_llama(tokenizer).to(torch.float64)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    common = dict(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4 // world_size,
        num_train_epochs=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        ddp_backend="gloo" if world_size > 1 else None,
    )
    callback = AdaptiveBatch(schedule=PhaseSchedule([4, 8], boundaries=[0.5]), micro_batch_size=int(micro))
    if kind == "trainer":
        trainer = Trainer(
            model=model,
            args=TrainingArguments(**common),
            train_dataset=token_dataset(tokenizer, texts[:43], max_length=24),
            data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
            callbacks=[callback],
        )
    else:
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        trainer = SFTTrainer(
            model=model,
            args=SFTConfig(**common, max_length=24),
            train_dataset=Dataset.from_dict({"text": texts[:43]}),
            processing_class=tokenizer,
            callbacks=[callback],
        )
    rank = trainer.args.process_index
    watcher = FakeOutOfMemory(trainer.model, max_rows=1) if fake_oom_rank == str(rank) else None
    trainer.train()
    result = {
        "rank": rank,
        "world_size": trainer.args.world_size,
        "plan": trainer._adaptive_batch.plan.fingerprint(),
        "logs": [log for log in trainer.state.log_history if "loss" in log],
        "raised": watcher.raised if watcher else [],
    }
    with open(os.path.join(output_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    torch.save(
        {k: v.detach().cpu() for k, v in trainer.model.named_parameters()}, f"{output_dir}/rank{rank}.pt"
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
