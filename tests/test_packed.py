"""Padding-free steps (DataCollatorWithFlattening, TRL's padding_free and packing): cut between sequences, every
per-sequence field rebuilt as the collator would have built it, the same training as the plain Trainer taking the
whole step at once, and the setups that would let packed sequences attend to each other refused."""

import pytest
import torch
from helpers import (
    ORDER_ONLY,
    ORDER_TOLERANCE,
    QUIET_CPU_RUN,
    Recording,
    assert_close_parameters,
    logged,
    parameters,
)
from transformers import DataCollatorWithFlattening

from adaptive_batch import AdaptiveBatch
from adaptive_batch.runtime.batch import is_packed
from adaptive_batch.runtime.packed import PackedStepBatch, check_packed_inputs
from adaptive_batch.testing import tiny_llama

FLATTEN = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)


@pytest.fixture
def varied(rows):
    """Rows of 3 to 24 tokens."""
    return [{"input_ids": row["input_ids"][: 3 + (7 * i) % 22]} for i, row in enumerate(rows[:40])]


def assert_same_batch(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("start, size", [(0, 1), (0, 3), (2, 4), (5, 3), (0, 8)])
def test_a_cut_is_the_batch_the_collator_makes_of_those_sequences(varied, start, size):
    step = varied[:8]
    assert is_packed(FLATTEN(step))
    batch = PackedStepBatch(FLATTEN(step))
    assert batch.rows == 8
    assert batch.lengths_list == [len(row["input_ids"]) for row in step]
    assert_same_batch(batch.take(start, size), FLATTEN(step[start : start + size]))


def test_sequences_are_found_from_position_ids_alone(varied):
    plain = DataCollatorWithFlattening()(varied[:5])
    assert set(plain) == {"input_ids", "labels", "position_ids"} and is_packed(plain)
    batch = PackedStepBatch(plain)
    assert batch.rows == 5 and batch.tokens(1, 2) == (sum(len(r["input_ids"]) for r in varied[1:3]),) * 2
    assert_same_batch(batch.take(1, 3), DataCollatorWithFlattening()(varied[1:4]))


def test_packed_token_chunks_count_tokens_without_padding(varied):
    batch = PackedStepBatch(FLATTEN([{"input_ids": list(range(n))} for n in (10, 30, 10, 20, 10, 20)]))
    assert batch.token_chunks(60) == [3, 3]  # 50 and 50 tokens (as many as fit would give 3, 3 too)
    assert batch.token_chunks(40) == [2, 3, 1]  # 40, 40 and 20 tokens: no budget under 40 keeps 3
    assert batch.token_chunks(1000, row_cap=4) == [3, 3]  # 50 and 50: the lowest peak of two


def test_a_filler_adds_nothing_and_the_label_counts_are_per_sequence(varied):
    batch = PackedStepBatch(FLATTEN(varied[:6]))
    filler = batch.dummy(count_items=True)
    assert filler["input_ids"].shape[1] == min(batch.lengths_list)
    assert (filler["labels"] == -100).all() and filler["cu_seq_lens_q"].tolist() == [
        0,
        min(batch.lengths_list),
    ]
    # every sequence's first label is ignored: the rest are counted
    assert batch.label_counts(shifted=True).tolist() == [n - 1 for n in batch.lengths_list]


def test_a_cut_that_would_split_a_loss_term_is_refused(varied):
    batch = FLATTEN(varied[:4])
    second = int(batch["cu_seq_lens_q"][1])
    batch["labels"][0, second] = 7
    with pytest.raises(ValueError, match=f"'labels' is 7 at position {second}, where a sequence starts"):
        PackedStepBatch(batch)


def test_values_that_are_not_per_token_are_refused(varied):
    batch = FLATTEN(varied[:4])
    batch["weights"] = torch.ones(4)
    with pytest.raises(ValueError, match=r"'weights' has shape \[4\], neither per token"):
        PackedStepBatch(batch)


def test_what_would_let_packed_sequences_attend_to_each_other_is_refused(tokenizer, varied):
    model = tiny_llama(tokenizer)
    batch = FLATTEN(varied[:4])
    check_packed_inputs(batch, model)  # no mask, no cache: fine
    with pytest.raises(ValueError, match="carries an attention_mask"):
        check_packed_inputs({**batch, "attention_mask": torch.ones_like(batch["input_ids"])}, model)
    model.config.use_cache = True
    with pytest.raises(ValueError, match=r"use_cache=True.*TrainingArguments\(use_cache=False\)"):
        check_packed_inputs(batch, model)
    check_packed_inputs({**batch, "use_cache": False}, model)  # as TRL passes it


@pytest.mark.parametrize("attention", ["eager", "sdpa", "flex_attention"])
def test_eager_sdpa_and_flex_attention_keep_packed_sequences_apart(tokenizer, varied, attention):
    # flex attention (the README's advice with padding_free=True) runs in float32 alone on the CPU, forward only
    dtype = torch.float32 if attention == "flex_attention" else torch.float64
    model = tiny_llama(tokenizer).to(dtype)
    model.config._attn_implementation = attention
    sequences = varied[:5]
    other = [
        {"input_ids": [t + 1 for t in sequences[0]["input_ids"]]},
        *sequences[1:],
    ]  # the first one changed
    first = len(sequences[0]["input_ids"])
    with torch.no_grad():
        packed = model(**DataCollatorWithFlattening()(sequences)).logits[0]
        changed = model(**DataCollatorWithFlattening()(other)).logits[0]
        # each sequence alone, the reference: under sdpa for flex attention, whose CPU kernel gets one single
        # sequence of these (24 tokens, after 3, 10 and 17) wrong by 0.2 on torch 2.13 while the packed row is right
        model.config._attn_implementation = "sdpa" if attention == "flex_attention" else attention
        alone = torch.cat([model(input_ids=torch.tensor([row["input_ids"]])).logits[0] for row in sequences])
    # what the first sequence holds reaches no other sequence, bit for bit
    assert not torch.equal(packed[:first], changed[:first]) and torch.equal(packed[first:], changed[first:])
    # and each sequence is as if alone (eager computes its softmax in float32: rounding of about 1e-7)
    atol = {"eager": 1e-6, "sdpa": 1e-12, "flex_attention": 1e-5}[attention]
    assert torch.allclose(packed, alone, rtol=0, atol=atol)


def train(make_trainer, dataset, callbacks=(), **overrides):
    settings = dict(
        dataset=dataset,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        num_train_epochs=2,
        train_sampling_strategy="sequential",
        trainer_class=Recording,
        **ORDER_ONLY,
    )
    trainer = make_trainer(callbacks, **{**settings, **overrides})
    trainer.data_collator = DataCollatorWithFlattening()
    trainer.train()
    return trainer


@pytest.mark.parametrize(
    "adaptive, user",
    [
        (dict(micro_batch_size=3), {}),
        (dict(max_tokens_per_micro_batch=64), {}),
        (dict(), dict(per_device_train_batch_size=2, gradient_accumulation_steps=4)),  # "auto" from 2 x 4
    ],
    ids=["3", "64 tokens", "auto"],
)
def test_flattened_steps_cut_between_sequences_train_as_whole_steps(make_trainer, varied, adaptive, user):
    whole = train(make_trainer, varied)
    cut = train(make_trainer, varied, [AdaptiveBatch(**adaptive)], **user)
    assert {rows for _, rows, *_ in whole.micro_batches} == {1}  # the plain Trainer: one flattened row a step
    per_step = [[m for m in cut.micro_batches if m[0] == k] for k in range(10)]
    assert any(len(micro) > 1 for micro in per_step)  # cut into several micro-batches
    if "max_tokens_per_micro_batch" in adaptive:  # a sequence longer than the budget runs alone
        assert all(length <= 64 or len(content) == 1 for _, _, length, _, content in cut.micro_batches)
    # every sample once per epoch: the sequences of the micro-batches are the dataset's rows, twice over
    trained = sorted(sequence for *_, content in cut.micro_batches for sequence in content)
    assert trained == sorted(tuple(r["input_ids"]) for r in varied for _ in range(2))
    assert logged(cut, "adaptive_batch/effective_batch_size") == [8] * 10
    assert logged(cut, "adaptive_batch/tokens_seen")[-1] == 2 * sum(len(r["input_ids"]) for r in varied)
    assert_close_parameters(parameters(cut.model), parameters(whole.model))


def test_trl_packing_with_the_one_line_trains_as_whole_packed_steps(tokenizer, texts, tmp_path):
    from datasets import Dataset
    from helpers import RecordingMixin
    from trl import SFTConfig, SFTTrainer

    class RecordingSFT(RecordingMixin, SFTTrainer):
        pass

    def run(name, callbacks):
        args = SFTConfig(
            output_dir=str(tmp_path / name),
            packing=True,  # TRL's default strategy, "bfd": padding-free rows of several examples
            max_length=64,
            per_device_train_batch_size=8,  # 72 texts pack into 64 rows: whole steps only (on a short one the
            num_train_epochs=2,  # plain Trainer's LR follows steps, AdaptiveBatch's samples)
            train_sampling_strategy="sequential",
            optim=ORDER_ONLY["optim"],
            learning_rate=ORDER_ONLY["learning_rate"],
            **QUIET_CPU_RUN,
            bf16=False,  # SFTConfig's default is True
        )
        trainer = RecordingSFT(
            model=tiny_llama(tokenizer).to(ORDER_ONLY["dtype"]),
            args=args,
            train_dataset=Dataset.from_dict({"text": texts[:72]}),
            processing_class=tokenizer,
            callbacks=callbacks,
        )
        trainer.train()
        return trainer

    whole = run("whole", [])
    cut = run("cut", [AdaptiveBatch(max_tokens_per_micro_batch=96)])
    assert {rows for _, rows, *_ in whole.micro_batches} == {1}  # one flattened row a step
    assert all(length <= 96 or len(content) == 1 for _, _, length, _, content in cut.micro_batches)
    assert len(cut.micro_batches) > 2 * len(whole.micro_batches)
    steps = len(whole.micro_batches)
    sequences = [
        sorted(s for m in run.micro_batches if m[0] == k for s in m[4])
        for run in (whole, cut)
        for k in range(steps)
    ]
    assert sequences[:steps] == sequences[steps:]  # the same sequences in every step
    for key in ("num_tokens", "learning_rate"):
        assert logged(cut, key) == logged(whole, key), key
    # TRL computes the log-probabilities itself, in float32 tiles of tokens (its fused LM head), and the whole step's
    # tokens fall into other tiles than the micro-batches': float32 rounding, which float64's 1e-10 cannot hold
    assert_close_parameters(parameters(cut.model), parameters(whole.model), rtol=1e-6)


@pytest.mark.parametrize(
    "settings",
    [{}, {"micro_batch_size": 64}, {"max_tokens_per_micro_batch": 1024}],
    ids=["auto", "rows", "tokens"],
)
def test_trl_packing_runs_a_step_the_plain_trainer_runs_whole_as_one_forward(
    tokenizer, texts, tmp_path, settings
):
    # the sizes count packed rows, as per_device_train_batch_size does: 8 rows of max_length 64 are one forward
    from datasets import Dataset
    from helpers import RecordingMixin
    from trl import SFTConfig, SFTTrainer

    class RecordingSFT(RecordingMixin, SFTTrainer):
        pass

    adaptive = AdaptiveBatch(**settings)
    args = SFTConfig(
        output_dir=str(tmp_path / "packed"),
        packing=True,
        max_length=64,
        per_device_train_batch_size=8,
        max_steps=4,
        **QUIET_CPU_RUN,
        bf16=False,
    )
    trainer = RecordingSFT(
        model=tiny_llama(tokenizer),
        args=args,
        train_dataset=Dataset.from_dict({"text": texts[:72]}),
        processing_class=tokenizer,
        callbacks=[adaptive],
    )
    trainer.train()
    assert [step for step, *_ in trainer.micro_batches] == [0, 1, 2, 3]  # one forward a step
    now = adaptive.current()
    if "max_tokens_per_micro_batch" not in settings:
        assert now["micro_batch_size"] == 8  # packed rows, as logged
        assert now["micro_batch_settled_because"] in (
            "it reached the 8 packed rows a step holds on a rank",
            "fixed by micro_batch_size",
        )
        assert "packed rows" in dict(adaptive.plan_table())["micro-batch"]


# -- a padding collator's rows run padding-free (padding_free=True) ---------------------------------------------------


def test_a_padded_step_flattened_is_the_batch_the_flattening_collator_makes(tokenizer, varied):
    from transformers import DataCollatorForLanguageModeling

    from adaptive_batch.runtime.packed import flatten_padded

    padded = DataCollatorForLanguageModeling(tokenizer, mlm=False)(varied[:6])
    assert_same_batch(flatten_padded(padded), DataCollatorWithFlattening()(varied[:6]))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda b: b.update(attention_mask=b["attention_mask"].flip(1)), "has padding before a token"),
        (lambda b: b.update(weights=torch.ones(len(b["input_ids"]))), r"'weights' is \[6\]"),
        (lambda b: b["labels"].masked_fill_(b["attention_mask"] == 0, 5), "labels on padding"),
        (lambda b: b.pop("attention_mask"), "need the step batch's attention_mask"),
    ],
    ids=["left padding", "per-row value", "labels on padding", "no mask"],
)
def test_what_cannot_be_flattened_is_refused(tokenizer, varied, change, message):
    from transformers import DataCollatorForLanguageModeling

    from adaptive_batch.runtime.packed import flatten_padded

    batch = DataCollatorForLanguageModeling(tokenizer, mlm=False)(varied[:6])
    change(batch)
    with pytest.raises(ValueError, match=message):
        flatten_padded(batch)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("adaptive", [dict(micro_batch_size=3), dict()], ids=["3", "auto"])
def test_padding_free_inside_the_step_trains_as_the_padded_run(make_trainer, varied, attention, adaptive):
    def run(callbacks):
        trainer = make_trainer(
            callbacks,
            dataset=varied,
            per_device_train_batch_size=8,
            gradient_accumulation_steps=1,
            num_train_epochs=2,
            train_sampling_strategy="sequential",
            trainer_class=Recording,
            **ORDER_ONLY,
        )
        trainer.model.config._attn_implementation = attention
        trainer.train()
        return trainer

    padded = run([])
    flat = run([AdaptiveBatch(padding_free=True, **adaptive)])
    assert {rows for _, rows, *_ in padded.micro_batches} == {8}  # the plain Trainer: padded rows
    # under eager and sdpa each micro-batch's sequences packed into rows as wide as the step's longest (to 64)
    assert {length % 64 for _, _, length, *_ in flat.micro_batches} == {0}
    trained = sorted(sequence for *_, content in flat.micro_batches for sequence in content)
    assert trained == sorted(tuple(r["input_ids"]) for r in varied for _ in range(2))
    assert logged(flat, "adaptive_batch/tokens_seen")[-1] == 2 * sum(len(r["input_ids"]) for r in varied)
    # eager attention computes its softmax in float32, whose rounding depends on the row's width (padded or not)
    tolerance = 1e-6 if attention == "eager" else ORDER_TOLERANCE
    assert_close_parameters(parameters(flat.model), parameters(padded.model), rtol=tolerance)
