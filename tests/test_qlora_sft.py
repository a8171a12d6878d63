"""A classic QLoRA script (4-bit NF4 base, LoRA, paged 8-bit AdamW, SFTTrainer, eval and save per epoch, early
stopping, best model at the end) runs unchanged but for the one line. bitsandbytes runs all of it on the CPU."""

import pytest
import torch

pytest.importorskip("bitsandbytes")
trl = pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from helpers import assert_same_parameters, logged, step_logs  # noqa: E402
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


@pytest.fixture(scope="module")
def long_texts(texts):
    """Paragraphs longer than max_length tokens: every row is cut to the same length, so no row is padded."""
    return [text for text in texts if len(text) > 400]


def qlora_trainer(base_model_dir, tokenizer, texts, output_dir, callbacks, num_texts=36, **overrides):
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
        train_dataset=Dataset.from_dict({"text": texts[:num_texts]}),
        eval_dataset=Dataset.from_dict({"text": texts[200:208]}),
        processing_class=tokenizer,
        peft_config=LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
        ),
        callbacks=callbacks,
    )


def test_classic_qlora_sft_script_with_the_one_line(base_model_dir, tokenizer, long_texts, tmp_path):
    def run(callbacks, name):
        trainer = qlora_trainer(
            base_model_dir,
            tokenizer,
            long_texts,
            tmp_path / name,
            callbacks=[*callbacks, EarlyStoppingCallback(early_stopping_patience=5)],
            train_sampling_strategy="sequential",  # the same samples in the same order in both runs
            # whole steps only: on an epoch's short step the LR follows samples, the plain Trainer's follows steps
            num_texts=32,
        )
        assert type(trainer.model.base_model.model.model.layers[0].self_attn.q_proj.base_layer).__name__ == (
            "Linear4bit"
        )
        trainer.train()
        return trainer

    plain = run([], "plain")
    trainer = run([AdaptiveBatch(micro_batch_size=2)], "adaptive")
    logs = step_logs(trainer)
    assert logged(trainer, "adaptive_batch/effective_batch_size") == [8] * 12
    assert logs[-1]["adaptive_batch/samples_seen"] == 96
    assert logs[-1]["num_tokens"] == logs[-1]["adaptive_batch/tokens_seen"]  # TRL's own count agrees
    assert [log["epoch"] for log in trainer.state.log_history if "eval_loss" in log] == [1.0, 2.0, 3.0]
    assert trainer.state.best_model_checkpoint.endswith(plain.state.best_model_checkpoint.rsplit("/", 1)[-1])
    # the plain SFTTrainer's micro-batches, in its order: the same run, bit for bit
    for key in ("loss", "num_tokens", "learning_rate"):
        assert logged(trainer, key) == logged(plain, key), key
    evals = [
        [log["eval_loss"] for log in t.state.log_history if "eval_loss" in log] for t in (trainer, plain)
    ]
    assert evals[0] == evals[1]
    assert_same_parameters(trainer.model, plain.model)


def test_the_one_line_with_automatic_micro_batches(base_model_dir, tokenizer, texts, tmp_path):
    trainer = qlora_trainer(
        base_model_dir, tokenizer, texts, tmp_path / "auto", callbacks=[AdaptiveBatch()], num_train_epochs=1
    )
    trainer.train()
    assert logged(trainer, "adaptive_batch/effective_batch_size") == [8] * 4 + [4]
    assert len(set(logged(trainer, "adaptive_batch/micro_batch_size"))) > 1  # sizes were tried
    assert step_logs(trainer)[-1]["num_tokens"] == step_logs(trainer)[-1]["adaptive_batch/tokens_seen"]


def test_sft_out_of_memory_retry_counts_tokens_once(base_model_dir, tokenizer, texts, tmp_path):
    def run(fake_rows, micro_batch_size=8):
        trainer = qlora_trainer(
            base_model_dir,
            tokenizer,
            texts,
            tmp_path / f"oom{fake_rows}",
            callbacks=[
                AdaptiveBatch(
                    schedule=PhaseSchedule([4, 8], boundaries=[0.5]), micro_batch_size=micro_batch_size
                )
            ],
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

    at_two, _ = run(None, micro_batch_size=2)
    retried, watcher = run(3)
    # the first step of 4 fails at 4 and runs at 2 (4 never ran a step, so it is not tried again): every
    # micro-batch holds 2
    assert watcher.raised == [4]
    assert logged(retried, "adaptive_batch/micro_batch_size") == logged(
        at_two, "adaptive_batch/micro_batch_size"
    )
    # the failed attempt left nothing behind, TRL's token count included: the run at 2 from the start, bit for bit
    for key in ("num_tokens", "loss"):
        assert logged(retried, key) == logged(at_two, key), key
    assert_same_parameters(retried.model, at_two.model)


@pytest.mark.parametrize(
    "padding_free, layout",
    [(None, "padding-free in rows"), (False, "padded (padding_free=False), without the padding mask")],
    ids=["in rows", "padded"],
)
def test_sft_ragged_rows_run_without_their_mask_and_count_the_same_tokens(
    base_model_dir, tokenizer, texts, tmp_path, padding_free, layout
):
    def run(callbacks, name):
        trainer = qlora_trainer(
            base_model_dir,
            tokenizer,
            texts,
            tmp_path / name,
            callbacks=callbacks,
            num_texts=16,
            num_train_epochs=1,
            eval_strategy="no",
            save_strategy="no",
            load_best_model_at_end=False,
            train_sampling_strategy="sequential",
        )
        inputs = []
        trainer.model.register_forward_pre_hook(
            lambda _, args, kwargs: inputs.append(set(kwargs)), with_kwargs=True
        )
        trainer.train()
        return trainer, inputs

    plain, plain_inputs = run([], "plain")
    adaptive = AdaptiveBatch(micro_batch_size=2, padding_free=padding_free)
    trainer, inputs = run([adaptive], "adaptive")
    assert all("attention_mask" in names for names in plain_inputs)
    # SFTTrainer counts tokens from position_ids where the mask is missing (every row's width, packed rows' tails
    # too): the step's real tokens are set in their place
    assert inputs and all("attention_mask" not in names and "position_ids" in names for names in inputs)
    assert dict(adaptive.plan_table())["layout"].startswith(layout)
    assert logged(trainer, "num_tokens") == logged(plain, "num_tokens")
    # the rows come longest first into other micro-batches: the bf16 sums round differently
    assert logged(trainer, "loss") == pytest.approx(logged(plain, "loss"), rel=0.05)
