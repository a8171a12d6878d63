"""The layout of a padding collator's steps, chosen for the user: padding-free where the model's attention reads
packed sequences at no cost beyond their tokens (flex, flash), padded and cut by tokens under sdpa and eager.

Flex attention has no backward on the CPU, and flash attention no CPU kernel, so the end-to-end runs register an
attention under a flash-like name that computes as sdpa does (with sdpa's mask): what the choice reads is the
name, and the padding-free steps are checked against the padded run as under any attention."""

import pytest
import torch
from helpers import ORDER_ONLY, ORDER_TOLERANCE, Recording, assert_close_parameters, parameters
from transformers import Trainer

from adaptive_batch import AdaptiveBatch
from adaptive_batch.core.controllers import FLEX_OVER_SDPA, SWITCH, UNMASKED_OVER_MASKED, choose_layout

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
    assert not choose_layout(None, False, "sdpa", True).flatten
    assert not choose_layout(None, False, "eager", True).flatten
    assert not choose_layout(None, False, "flex_attention", False).flatten  # one length: nothing to leave out
    assert not choose_layout(None, False, "flex_attention", None).flatten  # the first step tells
    assert not choose_layout(None, True, "flex_attention", True).flatten  # the collator flattens already
    assert choose_layout(True, False, "sdpa", True).flatten  # as stated
    assert not choose_layout(False, False, "flex_attention", True).flatten
    sdpa = choose_layout(None, False, "sdpa", True).text
    assert sdpa.startswith("padded: under sdpa a flattened step's mask is quadratic")
    assert 'attn_implementation="flex_attention"' in sdpa  # how to switch
    low, high = FLEX_OVER_SDPA
    assert f"an estimated {low:.1f}-{high:.1f}x the real tokens/s" in sdpa  # and what it would give
    assert 1 < low <= high
    assert SWITCH not in choose_layout(None, False, "sdpa", False).text  # one length: nothing to gain


def test_under_sdpa_a_causal_lms_padded_rows_leave_their_mask_out():
    for padding_free in (None, False):
        layout = choose_layout(padding_free, False, "sdpa", True, causal=True)
        assert layout.unmasked and not layout.flatten and "without the padding mask" in layout.text
    # the estimate's sdpa side ran with the mask, and the text says so, and what leaving it out gained
    chosen = choose_layout(None, False, "sdpa", True, causal=True).text
    low, high = UNMASKED_OVER_MASKED
    assert "of sdpa with its padding mask" in chosen and f"ran {low:.2f}-{high:.2f}x that" in chosen
    assert low <= 1 < high  # no gain on the bimodal mix's steady steps, and the text says as much
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


def run(make_trainer, dataset, attention, callbacks, trainer_class=Recording, inputs=None):
    """A run of two epochs in steps of 8 rows; `inputs` gets the names of every forward's keyword inputs."""
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
    adaptive = AdaptiveBatch(micro_batch_size=3)
    trainer = run(make_trainer, varied, "sdpa", [adaptive], Trainer, inputs)
    assert all("attention_mask" in names for names in plain_inputs)
    assert len(inputs) == 2 * 5 * 3 and not any("attention_mask" in names for names in inputs)
    assert dict(adaptive.plan_table())["layout"].startswith("padded, without the padding mask")
    assert_close_parameters(parameters(trainer.model), parameters(plain.model), rtol=ORDER_TOLERANCE)
    own = AdaptiveBatch(micro_batch_size=3)
    run(make_trainer, varied, "sdpa", [own], OwnLoss, own_inputs)  # the mask kept for a loss of its own
    assert own_inputs and all("attention_mask" in names for names in own_inputs)
    assert dict(own.plan_table())["layout"].startswith("padded: under sdpa")


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


def test_padding_free_false_and_sdpa_keep_the_padded_cut(make_trainer, varied):
    for attention, setting in [(FLASH_LIKE, dict(padding_free=False)), ("sdpa", {})]:
        adaptive = AdaptiveBatch(**setting)
        trainer = run(make_trainer, varied, attention, [adaptive])
        assert max(rows for _, rows, *_ in trainer.micro_batches) > 1  # padded rows
        assert dict(adaptive.plan_table())["layout"].startswith("padded")
