import pytest
import torch
from transformers import DataCollatorForLanguageModeling, DataCollatorWithFlattening

from adaptive_batch.runtime.batch import StepBatch
from adaptive_batch.testing import tiny_llama


@pytest.fixture
def collated(tokenizer, rows):
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    return collator([rows[i] for i in (0, 5, 9, 14, 20, 33)])


def test_rows_come_longest_first_and_trailing_padding_is_cut(collated):
    batch = StepBatch(collated)
    lengths = collated["attention_mask"].sum(1)
    assert batch.rows == 6 and batch.trimmable
    assert lengths[batch.order].tolist() == sorted(lengths.tolist(), reverse=True)
    tail = batch.take(3, 3)
    assert tail["input_ids"].shape == (3, int(lengths[batch.order[3]]))
    assert torch.equal(
        tail["input_ids"], collated["input_ids"][batch.order[3:]][:, : tail["input_ids"].shape[1]]
    )
    real, padded = batch.tokens(3, 3)
    assert real == int(lengths[batch.order[3:]].sum()) and padded == tail["input_ids"].numel()


def test_cutting_padding_does_not_change_the_model_output(collated, tokenizer):
    model = tiny_llama(tokenizer).to(torch.float64).eval()  # float64: only the cut could make a difference
    batch = StepBatch(collated)
    with torch.no_grad():
        full = model(**{k: v[batch.order[3:]] for k, v in collated.items()}).logits
        cut = model(**batch.take(3, 3)).logits
    length = cut.shape[1]
    mask = collated["attention_mask"][batch.order[3:], :length].bool()
    assert torch.allclose(full[:, :length][mask], cut[mask], rtol=1e-12, atol=0)


def test_micro_batches_are_contiguous_and_keep_the_collators_multiple(tokenizer, rows):
    # (a model may `.view` its inputs, as BartForCausalLM does its labels; Reformer refuses other lengths)
    collated = DataCollatorForLanguageModeling(tokenizer, mlm=False, pad_to_multiple_of=8)(
        [rows[i] for i in range(6)]
    )
    batch = StepBatch(collated, align=8)
    lengths = collated["attention_mask"].sum(1)[batch.order].tolist()
    for start in range(1, 6):
        chunk = batch.take(start, 1)
        assert all(value.is_contiguous() for value in chunk.values())
        assert chunk["input_ids"].shape[1] == -(-lengths[start] // 8) * 8
        assert batch.tokens(start, 1)[1] == chunk["input_ids"].numel() == batch.padded_tokens(start, 1)


def test_a_model_whose_rows_depend_on_their_padding_keeps_the_steps_width(collated):
    batch = StepBatch(collated, trims=False)  # (a check on the model showed a cut of padding changes it)
    assert not batch.trimmable and batch.take(3, 3)["input_ids"].shape[1] == collated["input_ids"].shape[1]


def test_left_padding_is_never_cut(collated):
    flipped = {k: v.flip(1) for k, v in collated.items()}
    batch = StepBatch(flipped)
    assert not batch.trimmable
    assert batch.take(0, 2)["input_ids"].shape[1] == collated["input_ids"].shape[1]


def test_labels_beyond_the_mask_keep_their_columns(collated):
    labels = collated["labels"].clone()
    labels[:, -1] = 7  # a label on a padded position still counts in the loss
    batch = StepBatch({**collated, "labels": labels})
    assert batch.take(3, 3)["input_ids"].shape[1] == collated["input_ids"].shape[1]


def test_dummy_row_has_every_label_ignored(collated):
    dummy = StepBatch(collated).dummy(count_items=True)
    assert dummy["input_ids"].shape[0] == 1 and bool((dummy["labels"] == -100).all())
    kept = StepBatch(collated).dummy(count_items=False)
    assert bool((kept["labels"] != -100).any())


def test_padding_free_batches_are_cut_by_their_sequences_not_their_rows(rows):
    from adaptive_batch.runtime.batch import is_packed
    from adaptive_batch.runtime.packed import PackedStepBatch

    flattened = DataCollatorWithFlattening()(
        [{"input_ids": r["input_ids"], "labels": r["input_ids"]} for r in rows[:3]]
    )
    assert is_packed(flattened) and PackedStepBatch(flattened).rows == 3
    with pytest.raises(ValueError, match="padding-free: cut it with PackedStepBatch"):
        StepBatch(flattened)


def test_values_without_one_entry_per_row_are_rejected(collated):
    with pytest.raises(ValueError, match="'pixel_values' has shape \\[2, 3\\]"):
        StepBatch({**collated, "pixel_values": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="'ids' is a list of 2 items"):
        StepBatch({**collated, "ids": [1, 2]})
    with pytest.raises(ValueError, match="nested mapping"):
        StepBatch({**collated, "extra": {"a": 1}})
    per_row = StepBatch({**collated, "ids": list(range(6)), "flag": True})
    chunk = per_row.take(0, 2)
    assert chunk["ids"] == per_row.order[:2].tolist() and chunk["flag"] is True


def test_a_causal_lms_rows_leave_their_mask_out_with_the_same_loss_and_gradients(collated, tokenizer):
    model = tiny_llama(tokenizer).to(torch.float64)
    masked, unmasked = StepBatch(collated), StepBatch(collated, unmasked=True, positions=True)
    assert not masked.unmasked and unmasked.unmasked
    chunk = unmasked.take(1, 4)
    assert "attention_mask" not in chunk and set(chunk) == {"input_ids", "labels", "position_ids"}
    assert chunk["position_ids"].tolist() == [list(range(chunk["input_ids"].shape[1]))] * 4
    assert 0 in masked.take(1, 4)["attention_mask"]  # there is padding to leave out

    def loss_and_gradients(inputs):
        model.zero_grad()
        loss = model(**inputs).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, gradients = loss_and_gradients(masked.take(1, 4))
    unmasked_loss, unmasked_gradients = loss_and_gradients(chunk)
    assert torch.allclose(loss, unmasked_loss, rtol=1e-12, atol=0)
    for grad, unmasked_grad in zip(gradients, unmasked_gradients):
        assert torch.allclose(grad, unmasked_grad, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize(
    "change",
    [
        lambda b: b["labels"].masked_fill_(b["attention_mask"] == 0, 5),  # a label on padding
        lambda b: b.update(position_ids=torch.ones_like(b["input_ids"])),  # positions not counted from 0
        lambda b: b.update(token_type_ids=torch.zeros_like(b["input_ids"])),  # an input that may read padding
        lambda b: b.update(attention_mask=b["attention_mask"].flip(1)),  # left padding
    ],
    ids=["labels on padding", "positions", "another input", "left padding"],
)
def test_the_mask_stays_wherever_leaving_it_out_could_change_the_loss(collated, change):
    change(collated)
    batch = StepBatch(collated, unmasked=True)
    assert not batch.unmasked and "attention_mask" in batch.take(0, 2)


def test_right_padded_positions_counted_from_0_are_replaced_by_their_count(collated):
    collated["position_ids"] = (collated["attention_mask"].cumsum(1) - 1).clamp_min(0) * collated[
        "attention_mask"
    ]
    batch = StepBatch(collated, unmasked=True)
    chunk = batch.take(0, 3)
    assert batch.unmasked and chunk["position_ids"][0].tolist() == list(range(chunk["input_ids"].shape[1]))
