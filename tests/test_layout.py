"""The layout of a padding collator's steps, chosen for the user: padding-free where the model's attention reads
packed sequences at no cost beyond their tokens (flex, flash); under sdpa and eager, a causal LM's sequences packed
into rows as wide as the step's longest (padding-free in rows), other models' rows padded and cut by tokens.

Flex attention has no backward on the CPU, and flash attention no CPU kernel, so the end-to-end runs register an
attention under a flash-like name that computes as sdpa does (with sdpa's mask): what the choice reads is the
name, and the padding-free steps are checked against the padded run as under any attention."""

import pytest
import torch
from helpers import ORDER_ONLY, ORDER_TOLERANCE, Recording, assert_close_parameters, parameters, sequences
from transformers import Trainer

from adaptive_batch import AdaptiveBatch
from adaptive_batch.core.controllers import FLEX_OVER_ROWS, FLEX_OVER_SDPA, SWITCH, choose_layout

FLASH_LIKE = "flash_like_sdpa_for_tests"


@pytest.fixture(scope="module", autouse=True)
def flash_like_attention():
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(FLASH_LIKE, sdpa_attention_forward)
    AttentionMaskInterface.register(FLASH_LIKE, sdpa_mask)


@pytest.fixture
def varied(rows):
    """Rows of 3 to 24 tokens."""
    return [{"input_ids": row["input_ids"][: 3 + (7 * i) % 22]} for i, row in enumerate(rows[:40])]


def test_the_layout_is_chosen_from_the_setting_the_collator_the_attention_and_the_lengths():
    assert choose_layout(None, False, "flex_attention", True).flatten
    assert choose_layout(None, False, "flash_attention_2", True).flatten
    assert not choose_layout(None, False, "sdpa", True).flatten  # not a causal LM read by the library alone
    assert not choose_layout(None, False, "eager", True).flatten
    for attention in ("sdpa", "eager"):  # a causal LM's: flattened, in rows
        layout = choose_layout(None, False, attention, True, causal=True)
        assert layout.flatten and layout.in_rows and layout.text.startswith("padding-free in rows")
        assert f"so {attention} masks every row" in layout.text
        low, high = FLEX_OVER_ROWS  # what flex attention would give, and how to switch
        assert f"an estimated {low:.2f}-{high:.2f}x the real tokens/s of padding-free in rows" in layout.text
        assert 'attn_implementation="flex_attention"' in layout.text and 1 < low <= high
        assert not choose_layout(None, False, attention, False, causal=True).flatten  # one length
        pending = choose_layout(None, False, attention, None, causal=True)  # the first step tells
        assert not pending.flatten and "padding-free in rows if they vary" in pending.text
    assert not choose_layout(
        None, False, "flex_attention", True, causal=True
    ).in_rows  # one row: no dense mask
    assert choose_layout(True, False, "sdpa", True).in_rows  # padding-free as stated, in rows under sdpa
    assert not choose_layout(None, False, "flex_attention", False).flatten  # one length: nothing to leave out
    assert not choose_layout(None, False, "flex_attention", None).flatten  # the first step tells
    assert not choose_layout(None, True, "flex_attention", True).flatten  # the collator flattens already
    assert choose_layout(True, False, "sdpa", True).flatten  # as stated
    assert not choose_layout(False, False, "flex_attention", True).flatten
    sdpa = choose_layout(None, False, "sdpa", True).text
    assert sdpa.startswith("padded: padding-free steps in rows need a causal LM")
    assert 'attn_implementation="flex_attention"' in sdpa  # how to switch
    low, high = FLEX_OVER_SDPA
    assert f"an estimated {low:.1f}-{high:.1f}x the real tokens/s" in sdpa  # and what it would give
    assert 1 < low <= high
    assert SWITCH not in choose_layout(None, False, "sdpa", False).text  # one length: nothing to gain


def test_under_sdpa_a_causal_lms_padded_rows_leave_their_mask_out():
    layout = choose_layout(False, False, "sdpa", True, causal=True)
    assert layout.unmasked and not layout.flatten and "without the padding mask" in layout.text
    assert choose_layout(None, False, "sdpa", None, causal=True).unmasked  # (any padding the first step has)
    assert not choose_layout(None, False, "sdpa", True).unmasked  # not a causal LM read by the library alone
    assert not choose_layout(None, False, "sdpa", False, causal=True).unmasked  # one length: no padding
    assert not choose_layout(True, False, "sdpa", True, causal=True).unmasked  # padding-free as stated
    for attention in (
        "eager",
        "flex_attention",
        "flash_attention_2",
        FLASH_LIKE,
    ):  # masked sdpa is the only gain
        assert not choose_layout(None, False, attention, True, causal=True).unmasked


def run(make_trainer, dataset, attention, callbacks, trainer_class=Recording, inputs=None, collator=None):
    """A run of two epochs in steps of 8 rows; `inputs` gets the names of every forward's keyword inputs;
    `collator` wraps the padding collator."""
    trainer = make_trainer(
        callbacks,
        dataset=dataset,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        num_train_epochs=2,
        train_sampling_strategy="sequential",
        trainer_class=trainer_class,
        **ORDER_ONLY,
    )
    trainer.model.config._attn_implementation = attention
    if collator is not None:
        trainer.data_collator = collator(trainer.data_collator)
    if inputs is not None:
        trainer.model.register_forward_pre_hook(
            lambda _, args, kwargs: inputs.append(set(kwargs)), with_kwargs=True
        )
    trainer.train()
    return trainer


class OwnLoss(Trainer):
    """A subclass's `compute_loss` may read the padding mask."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def test_under_sdpa_padded_rows_train_without_their_mask_as_the_plain_run(make_trainer, varied):
    plain_inputs, inputs, own_inputs = [], [], []
    plain = run(make_trainer, varied, "sdpa", [], Trainer, plain_inputs)
    adaptive = AdaptiveBatch(micro_batch_size=3, padding_free=False)
    trainer = run(make_trainer, varied, "sdpa", [adaptive], Trainer, inputs)
    assert all("attention_mask" in names for names in plain_inputs)
    assert len(inputs) == 2 * 5 * 3 and not any("attention_mask" in names for names in inputs)
    assert dict(adaptive.plan_table())["layout"].startswith(
        "padded (padding_free=False), without the padding mask"
    )
    assert_close_parameters(parameters(trainer.model), parameters(plain.model), rtol=ORDER_TOLERANCE)
    own = AdaptiveBatch(micro_batch_size=3)
    run(make_trainer, varied, "sdpa", [own], OwnLoss, own_inputs)  # the mask kept for a loss of its own
    assert own_inputs and all("attention_mask" in names for names in own_inputs)
    assert dict(own.plan_table())["layout"].startswith("padded: padding-free steps in rows need")


class OwnRecording(Recording):
    """A recording Trainer whose `compute_loss` is its own (it may read the padding mask)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class TorchRows(torch.utils.data.Dataset):
    """The rows behind a map-style torch Dataset, which cannot tell their lengths before training."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]


@pytest.mark.parametrize("wrap", [list, TorchRows], ids=["list", "torch Dataset"])
def test_by_default_ragged_steps_run_padding_free_where_the_attention_reads_packed_sequences(
    make_trainer, varied, wrap
):
    padded = run(make_trainer, varied, "sdpa", [])
    adaptive = AdaptiveBatch()
    flat = run(make_trainer, wrap(varied), FLASH_LIKE, [adaptive])
    assert {rows for _, rows, *_ in flat.micro_batches} == {1}  # every micro-batch one flattened row
    layout = dict(adaptive.plan_table())["layout"]
    assert layout.startswith("padding-free" if wrap is list else "padded until the first step")
    assert_close_parameters(parameters(flat.model), parameters(padded.model), rtol=ORDER_TOLERANCE)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("wrap", [list, TorchRows], ids=["list", "torch Dataset"])
def test_by_default_under_sdpa_and_eager_ragged_steps_run_padding_free_in_rows(
    make_trainer, varied, attention, wrap
):
    padded = run(make_trainer, varied, attention, [], Trainer)
    seen = []  # every forward's inputs: the library's own training_step, so the rows are a causal LM's alone
    adaptive = AdaptiveBatch()
    trainer = make_trainer(
        [adaptive],
        dataset=wrap(varied),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        num_train_epochs=2,
        train_sampling_strategy="sequential",
        **ORDER_ONLY,
    )
    trainer.model.config._attn_implementation = attention
    trainer.model.register_forward_pre_hook(lambda _, args, kwargs: seen.append(kwargs), with_kwargs=True)
    trainer.train()
    layout = dict(adaptive.plan_table())["layout"]
    assert layout.startswith("padding-free in rows" if wrap is list else "padded")
    packed = [
        inputs for inputs in seen if "attention_mask" not in inputs
    ]  # (a torch Dataset's first step: padded)
    assert len(packed) >= len(seen) - (0 if wrap is list else 2)
    assert all(
        inputs["input_ids"].shape[1] % 64 == 0 for inputs in packed
    )  # rows as wide as the step's longest
    assert any(inputs["input_ids"].shape[0] > 1 for inputs in packed)
    sequences_run = sorted(s for inputs in seen for s in sequences(inputs))
    assert sequences_run == sorted([tuple(row["input_ids"]) for row in varied] * 2)  # each once an epoch
    # eager's softmax over a row's 64 columns rounds otherwise than over the padded row's: each step's gradient
    # agrees to 3e-16, and ten steps at lr 0.1 magnify it to about 8e-10
    tolerance = ORDER_TOLERANCE if attention == "sdpa" else 1e-8
    assert_close_parameters(parameters(trainer.model), parameters(padded.model), rtol=tolerance)


def test_padding_free_false_and_a_loss_of_its_own_keep_the_padded_cut(make_trainer, varied):
    for attention, setting, cls in [
        (FLASH_LIKE, dict(padding_free=False), Recording),
        ("sdpa", {}, OwnRecording),
    ]:
        adaptive = AdaptiveBatch(**setting)
        trainer = run(make_trainer, varied, attention, [adaptive], cls)
        assert max(rows for _, rows, *_ in trainer.micro_batches) > 1  # padded rows
        assert dict(adaptive.plan_table())["layout"].startswith("padded")


class LeftPadding:
    """The padding collator's batches with each row's padding moved to its left."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, features):
        batch = self.collator(features)
        pads = (batch["attention_mask"] == 0).sum(dim=1).tolist()
        for key in ("input_ids", "attention_mask", "labels"):
            batch[key] = torch.stack([row.roll(n) for row, n in zip(batch[key], pads)])
        return batch


def test_a_chosen_layout_runs_a_batch_it_cannot_flatten_padded_and_a_stated_one_refuses_it(
    make_trainer, varied, caplog
):
    def left_padded(callbacks, inputs=None):
        return run(make_trainer, varied, "sdpa", callbacks, Trainer, inputs, LeftPadding)

    plain = left_padded([])
    adaptive, seen = AdaptiveBatch(), []
    with caplog.at_level("WARNING", logger="adaptive_batch"):
        trainer = left_padded([adaptive], seen)
    assert dict(adaptive.plan_table())["layout"].startswith("padding-free in rows")  # chosen
    assert caplog.text.count("steps run padded: Padding-free steps flatten right-padded rows") == 1
    # every micro-batch padded, its mask kept: the rows are left-padded
    assert seen and all("attention_mask" in names and "position_ids" not in names for names in seen)
    assert_close_parameters(parameters(trainer.model), parameters(plain.model), rtol=ORDER_TOLERANCE)
    with pytest.raises(ValueError, match="left padding would move every position.*padding_free=False"):
        left_padded([AdaptiveBatch(padding_free=True)])


def test_in_rows_an_out_of_memory_error_runs_the_step_again_smaller_and_trains_as_the_padded_run(
    make_trainer, varied
):
    from adaptive_batch.testing import FakeOutOfMemory

    padded = run(make_trainer, varied, "sdpa", [], Trainer)
    adaptive, seen = AdaptiveBatch(micro_batch_size=8), []
    trainer = make_trainer(
        [adaptive],
        dataset=varied,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        num_train_epochs=2,
        train_sampling_strategy="sequential",
        **ORDER_ONLY,
    )
    trainer.model.config._attn_implementation = "sdpa"
    # above 64 tokens a forward (rows x width) runs out of memory: a step's 8 sequences need two rows or more
    watcher = FakeOutOfMemory(trainer.model, max_rows=None, max_tokens=64)
    trainer.model.register_forward_pre_hook(lambda _, args, kwargs: seen.append(kwargs), with_kwargs=True)
    trainer.train()
    assert dict(adaptive.plan_table())["layout"].startswith("padding-free in rows")
    assert watcher.raised and max(watcher.tokens[-10:]) <= 64  # it raised, then every step fitted
    ran = [inputs for inputs in seen if inputs["input_ids"].numel() <= 64]  # the forwards that did not raise
    sequences_run = sorted(s for inputs in ran for s in sequences(inputs))
    assert sequences_run == sorted([tuple(row["input_ids"]) for row in varied] * 2)  # each once an epoch
    assert_close_parameters(parameters(trainer.model), parameters(padded.model), rtol=ORDER_TOLERANCE)
