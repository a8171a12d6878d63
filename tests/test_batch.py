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
