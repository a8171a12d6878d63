"""A classic QLoRA script (4-bit NF4 base, LoRA, paged 8-bit AdamW, SFTTrainer, eval and save per epoch, early
stopping, best model at the end) runs unchanged but for the one line. bitsandbytes runs all of it on the CPU."""

import pytest
import torch

pytest.importorskip("bitsandbytes")
trl = pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, EarlyStoppingCallback  # noqa: E402

from adaptive_batch import AdaptiveBatch, PhaseSchedule  # noqa: E402
from adaptive_batch.testing import FakeOutOfMemory, tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def base_model_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def qlora_trainer(base_model_dir, tokenizer, texts, output_dir, callbacks, **overrides):
    model = AutoModelForCausalLM.from_pretrained(
        base_model_dir,
        quantization_config=BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        ),
        device_map={"": "cpu"},
    )
    settings = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        num_train_epochs=3,
        learning_rate=2e-3,
        optim="paged_adamw_8bit",
        gradient_checkpointing=True,
        eval_strategy="epoch",
        save_strategy="epoch",
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        logging_steps=1,
        max_length=48,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    settings.update(overrides)
    return trl.SFTTrainer(
        model=model,
        args=trl.SFTConfig(**settings),
        train_dataset=Dataset.from_dict({"text": texts[:36]}),
        eval_dataset=Dataset.from_dict({"text": texts[200:208]}),
        processing_class=tokenizer,
        peft_config=LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
        ),
        callbacks=callbacks,
    )


@pytest.mark.slow
def test_classic_qlora_sft_script_with_the_one_line(base_model_dir, tokenizer, texts, tmp_path):
    trainer = qlora_trainer(
        base_model_dir,
        tokenizer,
        texts,
        tmp_path / "qlora",
        callbacks=[AdaptiveBatch(), EarlyStoppingCallback(early_stopping_patience=5)],
    )
    assert (
        type(trainer.model.base_model.model.model.layers[0].self_attn.q_proj.base_layer).__name__
        == "Linear4bit"
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    evals = [log for log in trainer.state.log_history if "eval_loss" in log]
    assert [log["adaptive_batch/effective_batch_size"] for log in logs] == ([8] * 4 + [4]) * 3
    assert logs[-1]["adaptive_batch/samples_seen"] == 108
    assert logs[-1]["num_tokens"] == logs[-1]["adaptive_batch/tokens_seen"]  # TRL's own count agrees
    assert [log["epoch"] for log in evals] == [1.0, 2.0, 3.0]
    assert trainer.state.best_model_checkpoint is not None
    after = {n: p.detach() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any(not torch.equal(before[n], after[n]) for n in before)


@pytest.mark.slow
def test_sft_out_of_memory_retry_counts_tokens_once(base_model_dir, tokenizer, texts, tmp_path):
    def run(fake_rows):
        trainer = qlora_trainer(
            base_model_dir,
            tokenizer,
            texts,
            tmp_path / f"oom{fake_rows}",
            callbacks=[AdaptiveBatch(schedule=PhaseSchedule([4, 8], boundaries=[0.5]), micro_batch_size=8)],
            num_train_epochs=1,
            eval_strategy="no",
            save_strategy="no",
            load_best_model_at_end=False,
            optim="adamw_torch",
            gradient_checkpointing=False,
        )
        # in the backward pass: TRL has already counted the micro-batch's tokens when it fails
        watcher = FakeOutOfMemory(trainer.model, fake_rows, in_backward=True) if fake_rows else None
        trainer.train()
        return trainer, watcher

    plain, _ = run(None)
    retried, watcher = run(3)
    assert watcher.raised == [4]  # the first step of 4 fails at 4, then every micro-batch holds 2
    plain_logs = [log for log in plain.state.log_history if "loss" in log]
    retried_logs = [log for log in retried.state.log_history if "loss" in log]
    assert [log["num_tokens"] for log in retried_logs] == [log["num_tokens"] for log in plain_logs]
    assert [log["adaptive_batch/micro_batch_size"] for log in retried_logs][-1] == 2
    assert retried_logs[-1]["loss"] == pytest.approx(plain_logs[-1]["loss"], rel=1e-3)
