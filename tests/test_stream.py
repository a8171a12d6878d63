"""Training streams (IterableDataset, `datasets` streaming): one pass over the budget, in order, exact."""

from __future__ import annotations

import pytest
import torch
from helpers import adaptive_of, assert_same_parameters, logged

from adaptive_batch import AdaptiveBatch, NoiseScaleSchedule
from adaptive_batch.runtime.stream import StreamEndedError


class Stream(torch.utils.data.IterableDataset):
    """The rows, in order, as a stream without a length (what a user's generator or a streaming dataset gives)."""

    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        yield from self.rows


class InputsSeen:
    """Every row of input_ids the model is given (padding stripped), in order. Under sdpa a causal LM's padded rows
    come without their mask, their padding labelled -100 (and this tokenizer's rows have no other -100 label)."""

    def __init__(self, model):
        self.rows: list[tuple[int, ...]] = []
        model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        kept = kwargs["attention_mask"].bool() if "attention_mask" in kwargs else kwargs["labels"] != -100
        for ids, mask in zip(kwargs["input_ids"], kept):
            self.rows.append(tuple(ids[mask].tolist()))


def run(make_trainer, dataset, output, **overrides):
    settings = dict(max_steps=5, per_device_train_batch_size=8, gradient_accumulation_steps=1)
    settings.update(overrides)
    # padded: a stream's first step cannot tell its lengths (so it runs padded), a list's can (padding-free in rows)
    callback = settings.pop("callback", None) or AdaptiveBatch(micro_batch_size=2, padding_free=False)
    trainer = make_trainer(
        callbacks=[callback],
        dataset=dataset,
        output_dir=str(output),
        train_sampling_strategy="sequential",
        **settings,
    )
    seen = InputsSeen(trainer.model)
    trainer.train()
    return trainer, seen.rows


def test_a_stream_trains_exactly_as_the_same_rows_read_in_order(make_trainer, rows, tmp_path):
    """max_steps=5 at 8 a step: the stream's first 40 rows, once, in order, in steps of 8 cut into micro-batches of
    2; the weights bit for bit those of a map-style run reading the same rows in order."""
    stream, streamed = run(make_trainer, Stream(rows[:100]), tmp_path / "stream")
    mapped, read = run(make_trainer, rows[:100], tmp_path / "map")
    expected = [tuple(row["input_ids"]) for row in rows[:40]]
    assert sorted(streamed) == sorted(expected) and sorted(read) == sorted(expected)
    assert_same_parameters(stream.model, mapped.model)
    assert logged(stream, "adaptive_batch/samples_seen") == [8, 16, 24, 32, 40]
    assert logged(stream, "adaptive_batch/accumulation_steps") == [4] * 5
    assert stream.state.global_step == 5


def test_workers_do_not_read_the_stream_twice(make_trainer, rows, tmp_path):
    one, alone = run(make_trainer, Stream(rows[:100]), tmp_path / "alone")
    two, workers = run(make_trainer, Stream(rows[:100]), tmp_path / "workers", dataloader_num_workers=2)
    assert workers == alone and len(workers) == 40
    assert_same_parameters(two.model, one.model)


def test_a_resumed_stream_goes_on_with_the_samples_after_its_checkpoint(make_trainer, rows, tmp_path):
    whole, _ = run(make_trainer, Stream(rows[:100]), tmp_path / "whole", save_strategy="steps", save_steps=3)
    checkpoint = str(tmp_path / "whole" / "checkpoint-3")
    resumed = make_trainer(
        callbacks=[AdaptiveBatch(micro_batch_size=2)],
        dataset=Stream(rows[:100]),
        output_dir=str(tmp_path / "resumed"),
        max_steps=5,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
    )
    seen = InputsSeen(resumed.model)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert sorted(seen.rows) == sorted(tuple(row["input_ids"]) for row in rows[24:40])
    assert_same_parameters(resumed.model, whole.model)


def test_a_growing_batch_reads_the_stream_once(make_trainer, rows, tmp_path, monkeypatch):
    from adaptive_batch.core.goodput import StepTimeModel

    monkeypatch.setattr(StepTimeModel, "predict", lambda self, rows, micro_batches: 1.0)  # growing is free
    schedule = NoiseScaleSchedule(8, max_size=32, min_samples_between_changes=16, confidence_z=0)
    trainer, seen = run(
        make_trainer,
        Stream(rows[:400]),
        tmp_path / "grow",
        max_steps=20,
        callback=AdaptiveBatch(schedule=schedule, micro_batch_size=4, lr_scaling="sqrt"),
    )
    assert schedule.changes, "the batch never grew"
    plan = adaptive_of(trainer).plan
    assert plan.num_samples == 20 * 8 and trainer.state.global_step == plan.num_steps < 20
    assert sorted(seen) == sorted(tuple(row["input_ids"]) for row in rows[:160])


def test_a_stream_with_datasets_streaming(make_trainer, rows, tmp_path):
    datasets = pytest.importorskip("datasets")
    stream = datasets.Dataset.from_list(rows[:100]).to_iterable_dataset()
    trainer, seen = run(make_trainer, stream, tmp_path / "hf")
    assert sorted(seen) == sorted(tuple(row["input_ids"]) for row in rows[:40])


def test_bad_streams_get_one_clear_error(make_trainer, rows, tmp_path):
    with pytest.raises(
        ValueError, match="max_steps"
    ):  # (the Trainer itself refuses a stream without max_steps)
        run(make_trainer, Stream(rows), tmp_path / "a", max_steps=-1)
    with pytest.raises(StreamEndedError, match=r"ended after 30 samples; max_steps=5 .* is 40 samples"):
        run(make_trainer, Stream(rows[:30]), tmp_path / "b")
    with pytest.raises(ValueError, match="a training stream and dataloader_num_workers=1"):
        run(
            make_trainer,
            Stream(rows),
            tmp_path / "c",
            dataloader_num_workers=1,
            callback=AdaptiveBatch(schedule=NoiseScaleSchedule(8, max_size=16)),
        )


def test_a_plain_trainer_s_checkpoint_of_a_stream_is_refused(make_trainer, rows, tmp_path):
    plain = make_trainer(
        dataset=Stream(rows[:100]),
        output_dir=str(tmp_path / "plain"),
        max_steps=2,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        save_strategy="steps",
        save_steps=2,
    )
    plain.train()
    adaptive = make_trainer(
        callbacks=[AdaptiveBatch(micro_batch_size=2)],
        dataset=Stream(rows[:100]),
        output_dir=str(tmp_path / "adaptive"),
        max_steps=5,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
    )
    with pytest.raises(ValueError, match="written by the plain Trainer, whose reading of a training stream"):
        adaptive.train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-2"))
