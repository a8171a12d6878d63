"""Out-of-memory errors: the step runs again smaller, nothing is lost or counted twice, one sample that never fits
gets one clear error. The model raises the real `torch.OutOfMemoryError` above a number of rows."""

import itertools
from types import SimpleNamespace

import pytest
import torch
from helpers import adaptive_of, assert_same_parameters, logged

import adaptive_batch.runtime.memory
from adaptive_batch import AdaptiveBatch, MicroBatchTooLargeError
from adaptive_batch.testing import FakeOutOfMemory


def run(make_trainer, micro_batch_size, max_rows=None, resume=None, output_dir=None, **fake):
    saving = dict(save_strategy="steps", save_steps=1, output_dir=str(output_dir)) if output_dir else {}
    trainer = make_trainer(
        # padded rows, which the fake error counts (a causal LM's ragged rows run padding-free in rows by default)
        [AdaptiveBatch(micro_batch_size=micro_batch_size, padding_free=False)],
        num_rows=32,
        dtype=torch.float64,
        **saving,
    )
    watcher = FakeOutOfMemory(trainer.model, max_rows, **fake) if max_rows is not None else None
    trainer.train(resume_from_checkpoint=resume)
    return trainer, watcher


@pytest.mark.parametrize("in_backward", [False, True])
def test_the_step_runs_again_at_half_until_it_fits(make_trainer, in_backward):
    reference, _ = run(make_trainer, micro_batch_size=2)
    trainer, watcher = run(make_trainer, micro_batch_size=8, max_rows=3, in_backward=in_backward)
    assert watcher.sizes[:6] == [8, 4, 2, 2, 2, 2]
    # neither 8 nor 4 ever ran a step: neither is tried again (a size that had run is: the tests below)
    assert watcher.raised == [8, 4]
    assert watcher.sizes[6:] == [2] * 12
    assert logged(trainer, "adaptive_batch/micro_batch_size") == [2, 2, 2, 2]
    # the failed attempts left nothing behind: the run is the one at 2 from the start, bit for bit
    assert_same_parameters(trainer.model, reference.model)
    assert logged(trainer, "loss") == logged(reference, "loss")


def test_an_out_of_memory_error_that_comes_back_shrinks_from_there_on(make_trainer, tmp_path):
    trainer, watcher = run(make_trainer, micro_batch_size=8, max_rows=7, only_after_calls=2)
    # steps 1-2 at 8; step 3 fails at 8, runs as 4+4; step 4 tries 8 again, fails again, runs as 4+4
    assert watcher.sizes == [8, 8, 8, 4, 4, 8, 4, 4]
    assert watcher.raised == [8, 8]
    assert trainer.state.global_step == 4
    # the run it should equal: two steps at 8, then 4 from step 3 on (a resume with micro_batch_size=4 stated)
    run(make_trainer, micro_batch_size=8, output_dir=tmp_path / "at8")
    checkpoint = str(tmp_path / "at8" / "checkpoint-2")
    reference, _ = run(make_trainer, micro_batch_size=4, resume=checkpoint, output_dir=tmp_path / "then4")
    assert logged(reference, "adaptive_batch/micro_batch_size") == [8, 8, 4, 4]
    assert logged(trainer, "adaptive_batch/micro_batch_size") == [8, 8, 4, 4]
    assert_same_parameters(trainer.model, reference.model)


@pytest.mark.parametrize("max_rows, raised, ran", [(7, [8], 4), (3, [8, 4], 2)], ids=["once", "twice"])
def test_a_transient_out_of_memory_error_costs_one_step(make_trainer, caplog, max_rows, raised, ran):
    # one long step, or a fragmented moment: the size halves for the step that failed (twice: the step fails again
    # at 4), then the size it first failed at comes back
    reference, _ = run(make_trainer, micro_batch_size=8)
    with caplog.at_level("WARNING", logger="adaptive_batch"):
        trainer, watcher = run(
            make_trainer, micro_batch_size=8, max_rows=max_rows, only_after_calls=1, times=len(raised)
        )
    assert watcher.raised == raised
    assert logged(trainer, "adaptive_batch/micro_batch_size") == [8, ran, 8, 8]
    assert "Trying micro-batch 8 again" in caplog.text
    assert logged(trainer, "adaptive_batch/samples_seen") == logged(reference, "adaptive_batch/samples_seen")


def test_growth_stops_below_the_size_that_ran_out(make_trainer, fixed_rows, monkeypatch):
    # every timed micro-batch lasts 1 s whatever its rows, so each doubling pays (on a busy CPU a real one may not)
    ticks = itertools.count(step=0.5)
    monkeypatch.setattr(
        adaptive_batch.runtime.memory, "time", SimpleNamespace(perf_counter=lambda: next(ticks))
    )
    trainer = make_trainer(
        [AdaptiveBatch()],
        dataset=fixed_rows[:64],
        per_device_train_batch_size=1,
        gradient_accumulation_steps=16,
    )
    watcher = FakeOutOfMemory(trainer.model, max_rows=5)
    trainer.train()
    now = adaptive_of(trainer).current()
    assert watcher.raised == [8]
    assert now["micro_batch_settled_because"] == "8 ran out of memory" and now["micro_batch_size"] <= 4
    assert max(watcher.sizes[watcher.sizes.index(8) + 1 :]) <= 4


def test_one_sample_that_never_fits_is_one_clear_error(make_trainer):
    trainer = make_trainer([AdaptiveBatch(micro_batch_size=8)], num_rows=32)
    FakeOutOfMemory(trainer.model, max_rows=0)
    with pytest.raises(
        MicroBatchTooLargeError, match="One sample per micro-batch of 32 tokens does not fit"
    ) as error:
        trainer.train()
    assert error.value.tried == [8, 4, 2, 1]
    assert "gradient_checkpointing=True" in str(error.value)
    assert trainer.state.global_step == 0


def test_errors_that_are_not_out_of_memory_propagate(make_trainer):
    trainer = make_trainer([AdaptiveBatch(micro_batch_size=4)], num_rows=32)

    def broken(module, args, kwargs, output):
        raise RuntimeError("shape mismatch in a custom layer")

    trainer.model.register_forward_hook(broken, with_kwargs=True)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        trainer.train()


def test_allocator_thrash_in_a_step_halves_the_micro_batch_for_the_next(make_trainer, monkeypatch, caplog):
    # the caching allocator freeing its cache to retry an allocation (CUDA's num_alloc_retries rising) warns of an
    # error to come: the next step runs at half, without running this one again; then the size is tried again
    from adaptive_batch.runtime import step

    readings = iter([0, 0, 0, 1] + [1] * 100)  # before and after each step: it rises during the second
    monkeypatch.setattr(step, "alloc_retries", lambda device: next(readings))
    monkeypatch.setattr(step, "peak_allocated", lambda device: 1.0)  # as on CUDA: the step's memory is read
    trainer = make_trainer([AdaptiveBatch(micro_batch_size=8)], num_rows=32)
    with caplog.at_level("WARNING", logger="adaptive_batch"):
        trainer.train()
    assert logged(trainer, "adaptive_batch/micro_batch_size") == [8, 8, 4, 8]
    assert "Allocator thrash at micro-batch 8: the next steps run at 4." in caplog.text
    assert logged(trainer, "adaptive_batch/samples_seen") == [8, 16, 24, 32]
