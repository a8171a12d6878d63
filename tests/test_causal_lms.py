"""Every causal LM the installed transformers builds small ([`causal_lms`]), under eager and sdpa, on right-padded
ragged rows: `AdaptiveBatch()` trains as the plain Trainer does (float64 and SGD: the order of additions alone
apart, [`TOLERANCE`]), packing sequences only where a forward on the model showed it exact, else padded with a log line naming the
model; `padding_free=True` trains as the plain Trainer does in micro-batches of 3 sequences, or is refused before
training; the padded cut in micro-batches of 3 rows trains as it too (the loss's label shift and divisor as shown on
the model: BartForCausalLM's own mean over unshifted labels).

The plain Trainer runs each step as one batch of 8 rows: the step's gradient, whatever the model's loss divides by.
A type that cannot be built small is skipped with its reason from `causal_lms.NOT_BUILDABLE` (`pytest -rs` lists
them)."""

from __future__ import annotations

import logging

import pytest
import torch
from causal_lms import (
    NOT_BUILDABLE,
    PAD_TO_MULTIPLE_OF,
    PAD_TOKEN_ID,
    VOCAB_SIZE,
    build_small,
    causal_lm_types,
    supports_sdpa,
)
from helpers import ORDER_ONLY, QUIET_CPU_RUN, keep_loss_in_float64
from transformers import Trainer, TrainingArguments

from adaptive_batch import AdaptiveBatch

STEP_ROWS, NUM_ROWS = 8, 16  # two steps
# the order of additions over two SGD steps, relative to the update: float64 models' attention under eager, and some
# routers and norms, still compute in float32 (5e-7 seen at most, gemma4); float32 models (3.8e-6 seen, blt)
TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-4}


def ragged_rows() -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 41, (NUM_ROWS,), generator=generator).tolist()
    return [{"input_ids": torch.randint(3, VOCAB_SIZE, (n,), generator=generator).tolist()} for n in lengths]


class PadRight:
    """A padding collator as users write them: right padding, its mask, labels ignored on padding."""

    def __init__(self, pad_to_multiple_of: int = 1):
        self.pad_to_multiple_of = pad_to_multiple_of  # (as transformers' collators name it)

    def __call__(self, features: list[dict]) -> dict:
        width = max(len(f["input_ids"]) for f in features)
        width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        ids = torch.full((len(features), width), PAD_TOKEN_ID)
        mask = torch.zeros_like(ids)
        for row, feature in enumerate(features):
            n = len(feature["input_ids"])
            ids[row, :n], mask[row, :n] = torch.tensor(feature["input_ids"]), 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def trainer_for(model_type: str, attention: str, callbacks: list, tmp_path, **settings) -> Trainer:
    model = build_small(model_type)
    model.config._attn_implementation = attention
    if model.dtype == torch.float64:
        keep_loss_in_float64(model)
    args = dict(per_device_train_batch_size=STEP_ROWS, gradient_accumulation_steps=1, num_train_epochs=1)
    args.update(ORDER_ONLY, train_sampling_strategy="sequential", **QUIET_CPU_RUN)
    del args["dtype"]
    args.update(settings)
    return Trainer(
        model=model,
        args=TrainingArguments(output_dir=str(tmp_path / "out"), **args),
        train_dataset=ragged_rows(),
        data_collator=PadRight(PAD_TO_MULTIPLE_OF.get(model_type, 1)),
        callbacks=callbacks,
    )


def trained(trainer: Trainer) -> dict[str, torch.Tensor]:
    """What training changed: each parameter's update (their initial values are the same in every run: seeded)."""
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    return {name: p.detach() - before[name] for name, p in trainer.model.named_parameters()}


def assert_same_updates(updates: dict, plain: dict, tolerance: float) -> None:
    """The updates equal the plain run's, relative to the size of its whole update (a parameter whose gradient is
    zero by symmetry, as a key's bias, holds rounding alone: relative to itself it would say nothing)."""
    assert updates.keys() == plain.keys()
    scale = torch.sqrt(sum((u.double() ** 2).sum() for u in plain.values()))
    worst = max(plain, key=lambda name: float((updates[name] - plain[name]).norm()))
    difference = torch.sqrt(sum(((updates[n] - plain[n]).double() ** 2).sum() for n in plain)) / scale
    assert difference < tolerance, f"relative difference {difference:.2e}, most in {worst}"


def layout_row(adaptive: AdaptiveBatch) -> str:
    return dict(adaptive.plan_table())["layout"]


CASES = [
    pytest.param(model_type, attention, id=f"{model_type}-{attention}")
    for model_type in causal_lm_types()
    for attention in ("eager", "sdpa")
]


@pytest.mark.slow
@pytest.mark.parametrize("model_type, attention", CASES)
def test_every_causal_lm_trains_as_under_the_plain_trainer(model_type, attention, tmp_path, caplog):
    if model_type in NOT_BUILDABLE:
        pytest.skip(f"{model_type} cannot be built small: {NOT_BUILDABLE[model_type]}")
    if attention == "sdpa" and not supports_sdpa(build_small(model_type)):
        pytest.skip(f"{model_type} has no sdpa attention")
    plain = trained(trainer_for(model_type, attention, [], tmp_path))
    model = build_small(model_type)
    name = type(model.get_base_model() if hasattr(model, "get_base_model") else model).__name__
    tolerance = TOLERANCE[model.dtype]

    default = AdaptiveBatch()
    with caplog.at_level(logging.WARNING, logger="adaptive_batch"):
        assert_same_updates(
            trained(trainer_for(model_type, attention, [default], tmp_path)), plain, tolerance
        )
    layout = layout_row(default)
    packed = layout.startswith("padding-free in rows") and f"(shown exact on {name}: logits within " in layout
    fell_back = layout.startswith("padded") and f"as {name} " in layout
    assert packed or fell_back, layout
    if fell_back:  # (one line in the log, naming the model and what was measured)
        assert f"AdaptiveBatch: steps run padded: {name} " in caplog.text

    stated = AdaptiveBatch(padding_free=True, micro_batch_size=3)
    try:
        trainer = trainer_for(model_type, attention, [stated], tmp_path)
    except ValueError as refused:
        assert str(refused).startswith(f"padding_free=True: {name} "), refused
        assert "Pass AdaptiveBatch(padding_free=None)" in str(refused)
        assert not packed  # refused only where the default does not pack either
    else:
        assert f"shown exact on {name}" in layout_row(stated)
        assert_same_updates(trained(trainer), plain, tolerance)

    cut = AdaptiveBatch(micro_batch_size=3, padding_free=False)
    assert_same_updates(trained(trainer_for(model_type, attention, [cut], tmp_path)), plain, tolerance)


def opt_model(vocab_size: int = VOCAB_SIZE):
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    config = OPTConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=32,
        pad_token_id=PAD_TOKEN_ID,
        dropout=0.0,
        attention_dropout=0.0,
    )
    config._attn_implementation = "sdpa"
    return keep_loss_in_float64(OPTForCausalLM(config).double())


@pytest.mark.slow
def test_a_peft_lora_model_that_mixes_packed_sequences_falls_back_and_trains_as_the_plain_trainer(
    tmp_path, caplog
):
    from peft import LoraConfig, get_peft_model

    def run(callbacks):
        model = get_peft_model(
            opt_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        )
        args = dict(per_device_train_batch_size=STEP_ROWS, num_train_epochs=1, optim="sgd", learning_rate=0.1)
        trainer = Trainer(
            model=model,
            args=TrainingArguments(
                str(tmp_path / "out"), train_sampling_strategy="sequential", **args, **QUIET_CPU_RUN
            ),
            train_dataset=ragged_rows(),
            data_collator=PadRight(),
            callbacks=callbacks,
        )
        return trained(trainer)

    plain = run([])
    adaptive = AdaptiveBatch(micro_batch_size=3)
    with caplog.at_level(logging.WARNING, logger="adaptive_batch"):
        assert_same_updates(run([adaptive]), plain, TOLERANCE[torch.float64])
    assert "AdaptiveBatch: steps run padded: OPTForCausalLM changes a sequence's logits" in caplog.text
    assert layout_row(adaptive).startswith("padded, without the padding mask")
    assert "not packed, as OPTForCausalLM changes a sequence's logits by up to" in layout_row(adaptive)


@pytest.mark.slow
def test_sft_trainer_on_a_model_that_mixes_packed_sequences_falls_back_and_trains_as_the_plain_one(
    tmp_path, caplog, tokenizer, texts
):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    def run(callbacks):
        trainer = trl.SFTTrainer(  # the tutorial setup: SFTConfig's defaults but for the optimizer and length
            model=opt_model(len(tokenizer)),
            args=trl.SFTConfig(
                str(tmp_path / "out"),
                per_device_train_batch_size=4,
                gradient_accumulation_steps=2,
                num_train_epochs=1,
                optim="sgd",
                learning_rate=0.1,
                max_length=40,
                train_sampling_strategy="sequential",
                **QUIET_CPU_RUN,
            ),
            train_dataset=Dataset.from_dict({"text": texts[:16]}),
            processing_class=tokenizer,
            callbacks=callbacks,
        )
        return trained(trainer), trainer

    plain, plain_trainer = run([])
    adaptive = AdaptiveBatch()
    with caplog.at_level(logging.WARNING, logger="adaptive_batch"):
        updates, trainer = run([adaptive])
    assert_same_updates(updates, plain, TOLERANCE[torch.float64])
    assert "AdaptiveBatch: steps run padded: OPTForCausalLM changes" in caplog.text
    assert layout_row(adaptive).startswith("padded")
    num_tokens = [log["num_tokens"] for log in trainer.state.log_history if "num_tokens" in log]
    assert num_tokens == [log["num_tokens"] for log in plain_trainer.state.log_history if "num_tokens" in log]
    with pytest.raises(ValueError, match=r"^padding_free=True: OPTForCausalLM changes a sequence's logits"):
        run([AdaptiveBatch(padding_free=True)])
