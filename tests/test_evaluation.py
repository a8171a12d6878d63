"""Evaluation and prediction that survive an out-of-memory error: the eval batch runs again in pieces, and the
metrics are the plain Trainer's (the loss to rounding in float64, the `compute_metrics` inputs equal). The model
raises the real `torch.OutOfMemoryError` above a number of rows, in evaluation too (`in_eval=True`)."""

import numpy as np
import pytest
import torch
from helpers import BlockClock, eval_pieces

import adaptive_batch.runtime.memory
from adaptive_batch import AdaptiveBatch, MicroBatchTooLargeError
from adaptive_batch.testing import FakeOutOfMemory

EVAL = dict(per_device_eval_batch_size=8, dtype=torch.float64)


class Recorder:
    """A `compute_metrics` that keeps what it was given."""

    def __init__(self):
        self.predictions = self.label_ids = None

    def __call__(self, prediction):
        self.predictions, self.label_ids = prediction.predictions, prediction.label_ids
        return {"checked": 1.0}


def evaluated(make_trainer, rows, callbacks=(), max_rows=None, **overrides):
    trainer = make_trainer(list(callbacks), eval_dataset=rows[:27], **{**EVAL, **overrides})
    trainer.compute_metrics = Recorder()
    watcher = FakeOutOfMemory(trainer.model, max_rows, in_eval=True) if max_rows is not None else None
    return trainer, watcher


def assert_same_inputs(recorded: Recorder, plain: Recorder):
    assert np.array_equal(recorded.label_ids, plain.label_ids)
    assert recorded.predictions.shape == plain.predictions.shape
    np.testing.assert_allclose(recorded.predictions, plain.predictions, rtol=1e-12, atol=1e-12)


def test_an_out_of_memory_error_in_evaluation_runs_the_batch_again_in_pieces(make_trainer, rows, caplog):
    plain, _ = evaluated(make_trainer, rows)
    expected = plain.evaluate()
    trainer, watcher = evaluated(make_trainer, rows, [AdaptiveBatch()], max_rows=3)
    with caplog.at_level("WARNING", logger="adaptive_batch"):
        metrics = trainer.evaluate()
    # the first batch of 8 fails at 8 and at 4, runs as 3 + 3 + 2 ... in pieces of 2; later batches start at 2
    assert watcher.raised == [8, 4]
    assert watcher.sizes[:2] == [8, 4] and set(watcher.sizes[2:]) == {2, 1}
    assert "running the eval batch again in pieces of 2 rows" in caplog.text
    assert metrics["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-12)
    assert metrics["eval_checked"] == 1.0
    assert_same_inputs(trainer.compute_metrics, plain.compute_metrics)
    assert metrics["eval_adaptive_batch/micro_batch_size"] == 2
    assert metrics["eval_adaptive_batch/batches_retried"] == 1
    # without an error: the whole batches, and the same loss bit for bit
    clean, _ = evaluated(make_trainer, rows, [AdaptiveBatch()])
    again = clean.evaluate()
    assert again["eval_loss"] == expected["eval_loss"]
    assert (
        again["eval_adaptive_batch/micro_batch_size"] == 8
        and again["eval_adaptive_batch/batches_retried"] == 0
    )


def test_evaluation_during_training_survives_and_training_is_unchanged(make_trainer, rows):
    settings = dict(eval_strategy="steps", eval_steps=2, num_rows=24)
    plain, _ = evaluated(make_trainer, rows, **settings)
    plain.train()
    # (training's micro-batches of 4 fit: the errors come in evaluation alone)
    trainer, watcher = evaluated(
        make_trainer, rows, [AdaptiveBatch(micro_batch_size=4)], max_rows=5, **settings
    )
    trainer.train()
    assert watcher.raised == [8]  # once: the evaluations after start at 4
    history = [log for log in trainer.state.log_history if "eval_loss" in log]
    plain_history = [log for log in plain.state.log_history if "eval_loss" in log]
    assert [log["step"] for log in history] == [log["step"] for log in plain_history] == [2, 3]
    for log, plain_log in zip(history, plain_history):
        assert log["eval_loss"] == pytest.approx(plain_log["eval_loss"], rel=1e-12)
    assert [log["eval_adaptive_batch/micro_batch_size"] for log in history] == [4, 4]
    assert trainer.state.global_step == plain.state.global_step


def test_predict_survives_and_returns_the_plain_trainers_predictions(make_trainer, rows):
    plain, _ = evaluated(make_trainer, rows)
    expected = plain.predict(rows[:27])
    trainer, watcher = evaluated(make_trainer, rows, [AdaptiveBatch()], max_rows=4)
    output = trainer.predict(rows[:27])
    assert watcher.raised == [8]
    assert np.array_equal(output.label_ids, expected.label_ids)
    np.testing.assert_allclose(output.predictions, expected.predictions, rtol=1e-12, atol=1e-12)
    assert output.metrics["test_loss"] == pytest.approx(expected.metrics["test_loss"], rel=1e-12)
    assert output.metrics["test_adaptive_batch/micro_batch_size"] == 4


def test_eval_accumulation_steps_are_respected(make_trainer, rows):
    plain, _ = evaluated(make_trainer, rows, eval_accumulation_steps=2)
    expected = plain.evaluate()
    trainer, _ = evaluated(make_trainer, rows, [AdaptiveBatch()], max_rows=3, eval_accumulation_steps=2)
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-12)
    assert_same_inputs(trainer.compute_metrics, plain.compute_metrics)


def test_adapt_evaluation_false_keeps_the_plain_evaluation(make_trainer, rows):
    trainer, _ = evaluated(make_trainer, rows, [AdaptiveBatch(adapt_evaluation=False)], max_rows=3)
    with pytest.raises(torch.OutOfMemoryError):
        trainer.evaluate()


def test_one_row_that_never_fits_is_one_clear_error(make_trainer, rows):
    trainer, _ = evaluated(make_trainer, rows, [AdaptiveBatch()], max_rows=0)
    with pytest.raises(MicroBatchTooLargeError, match="One row of an eval batch does not fit") as error:
        trainer.evaluate()
    assert error.value.tried == [8, 4, 2, 1]


def test_sft_trainer_evaluation_survives_with_its_own_metrics(tokenizer, texts, tmp_path):
    """TRL's SFTTrainer appends its entropy and token accuracy once per eval batch: a batch run in pieces appends
    them once too (the pieces' values weighted by their label tokens), and a failed attempt's are taken back."""
    import trl
    from datasets import Dataset
    from helpers import QUIET_CPU_RUN, keep_loss_in_float64

    from adaptive_batch.testing import tiny_llama

    def evaluate(callbacks, max_rows=None):
        trainer = trl.SFTTrainer(
            model=keep_loss_in_float64(tiny_llama(tokenizer).to(torch.float64)),
            args=trl.SFTConfig(
                output_dir=str(tmp_path / "out"), per_device_eval_batch_size=8, max_length=24, **QUIET_CPU_RUN
            ),
            train_dataset=Dataset.from_dict({"text": texts[:16]}),
            eval_dataset=Dataset.from_dict({"text": texts[200:220]}),
            processing_class=tokenizer,
            callbacks=callbacks,
        )
        watcher = FakeOutOfMemory(trainer.model, max_rows, in_eval=True) if max_rows is not None else None
        return trainer.evaluate(), watcher

    expected, _ = evaluate([])
    metrics, watcher = evaluate([AdaptiveBatch()], max_rows=3)
    assert watcher.raised == [8, 4]
    assert metrics["eval_adaptive_batch/batches_retried"] == 1
    assert metrics["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-12)
    # (TRL divides its sums in float32, once per batch; the pieces' weighted mean is taken in float64)
    for key in ("eval_entropy", "eval_mean_token_accuracy"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-6), key


def sizes_and_losses(trainer, evaluations: int) -> tuple[list[int], list[float]]:
    sizes, losses = [], []
    for _ in range(evaluations):
        metrics = trainer.evaluate()
        sizes.append(metrics["eval_adaptive_batch/micro_batch_size"])
        losses.append(metrics["eval_loss"])
    return sizes, losses


def test_grow_doubles_the_eval_batch_between_evaluations_while_it_pays(
    make_trainer, rows, monkeypatch, caplog
):
    # 27 rows in 4, 2, 1.5 and 1.49 s: 2 -> 4 -> 8 -> 16, which is less than 1% faster than 8, so 8 is kept
    monkeypatch.setattr(adaptive_batch.runtime.memory, "time", BlockClock([4.0, 2.0, 1.5, 1.49, 1.5]))
    trainer, _ = evaluated(
        make_trainer, rows, [AdaptiveBatch(adapt_evaluation="grow")], per_device_eval_batch_size=2
    )
    with caplog.at_level("INFO", logger="adaptive_batch"):
        sizes, losses = sizes_and_losses(trainer, 5)
    assert sizes == [2, 4, 8, 16, 8]
    assert "Eval batch settled at 8: 16 ran 18.1 rows/s against 18.0 at 8" in caplog.text
    assert trainer.args.per_device_eval_batch_size == 2  # the user's, outside an evaluation
    for size, loss in zip(
        sizes, losses
    ):  # each evaluation is the plain Trainer's at its eval batch, bit for bit
        plain, _ = evaluated(make_trainer, rows, per_device_eval_batch_size=size)
        assert plain.evaluate()["eval_loss"] == loss


def test_grow_stops_at_the_size_that_ran_after_an_out_of_memory_error(make_trainer, rows, monkeypatch):
    monkeypatch.setattr(adaptive_batch.runtime.memory, "time", BlockClock([4.0, 2.0, 1.0, 1.0, 1.0]))
    trainer, watcher = evaluated(
        make_trainer, rows, [AdaptiveBatch(adapt_evaluation="grow")], max_rows=5, per_device_eval_batch_size=2
    )
    metrics = [trainer.evaluate() for _ in range(4)]
    # 8 runs out of memory: its batches run in pieces of 4, and 4 is the eval batch from then on
    assert watcher.raised == [8]
    assert [m["eval_adaptive_batch/micro_batch_size"] for m in metrics] == [2, 4, 4, 4]
    assert [m["eval_adaptive_batch/batches_retried"] for m in metrics] == [0, 0, 1, 0]
    plain, _ = evaluated(make_trainer, rows, per_device_eval_batch_size=8)
    assert metrics[2]["eval_loss"] == pytest.approx(plain.evaluate()["eval_loss"], rel=1e-12)


def test_adapt_evaluation_takes_true_false_or_grow():
    with pytest.raises(ValueError, match=r"adapt_evaluation='bigger' must be True .*'grow'"):
        AdaptiveBatch(adapt_evaluation="bigger")
    with pytest.raises(ValueError, match=r"adapt_evaluation=1 must be True"):
        AdaptiveBatch(adapt_evaluation=1)


def test_grow_runs_loss_only_batches_of_ragged_rows_in_pieces_of_similar_lengths(make_trainer, rows):
    # without compute_metrics the Trainer keeps no logits: each batch's rows run grouped by length, each group padded
    # to its own longest row, and the loss is the batch's (weighted by label tokens)
    ragged = [{"input_ids": row["input_ids"][: 3 + (7 * i) % 30]} for i, row in enumerate(rows[:27])]

    def run(callbacks, overhead=None, max_rows=None):
        trainer = make_trainer(callbacks, eval_dataset=ragged, **EVAL)
        if overhead is not None:  # (a forward's fixed time, as fitted from earlier forwards' times)
            eval_pieces(trainer).overhead = overhead
        watcher = FakeOutOfMemory(trainer.model, max_rows, in_eval=True)
        return trainer.evaluate(), watcher

    expected, plain = run([])
    metrics, cut = run([AdaptiveBatch(adapt_evaluation="grow")], overhead=8)
    assert metrics["eval_adaptive_batch/batches_cut_by_tokens"] >= 1
    assert len(cut.sizes) > len(plain.sizes) and sum(cut.sizes) == sum(plain.sizes) == 27
    assert sum(cut.tokens) < sum(plain.tokens)  # fewer padded tokens
    assert metrics["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-12)
    # a piece that runs out of memory: the batch runs again in halves of its rows, and the loss is still the batch's
    oom, _ = run([AdaptiveBatch(adapt_evaluation="grow")], overhead=8, max_rows=2)
    assert oom["eval_adaptive_batch/batches_retried"] >= 1
    assert oom["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-12)
    # the default keeps the Trainer's batches, bit for bit
    default, same = run([AdaptiveBatch()])
    assert same.sizes == plain.sizes and default["eval_loss"] == expected["eval_loss"]


def test_the_fixed_time_of_an_eval_forward_is_fitted_from_the_forwards_times(make_trainer, rows):
    # until four forwards are timed the batches run whole; then the line of seconds against padded tokens gives
    # the fixed time of a forward: here 0.5 s + 1 ms per token, so 500 tokens' worth
    trainer = make_trainer([AdaptiveBatch(adapt_evaluation="grow")], eval_dataset=rows[:27], **EVAL)
    pieces = eval_pieces(trainer)
    batch = {
        "input_ids": torch.ones(4, 10, dtype=torch.long),
        "attention_mask": torch.ones(4, 10, dtype=torch.long),
    }
    for count, seconds in ((1, 0.51), (2, 0.52), (3, 0.53)):
        pieces._timed(batch, 4, slice(0, count), None, seconds)
        assert pieces.overhead is None
    pieces._timed(batch, 4, torch.tensor([0, 1, 2, 3]), 5, 0.52)  # 4 rows at their own width of 5
    assert pieces.points[-1] == (20.0, 0.52) and pieces.overhead == 500
