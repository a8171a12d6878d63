"""Out-of-memory errors: the step runs again smaller, nothing is lost or counted twice, one sample that never fits
gets one clear error. The model raises the real `torch.OutOfMemoryError` above a number of rows."""

import pytest
import torch
from conftest import assert_close_parameters, parameters

from adaptive_batch import AdaptiveBatch, MicroBatchTooLargeError
from adaptive_batch.testing import FakeOutOfMemory


def run(make_trainer, micro_batch_size, max_rows=None, **fake):
    trainer = make_trainer(
        [AdaptiveBatch(micro_batch_size=micro_batch_size)], num_rows=32, dtype=torch.float64
    )
    watcher = FakeOutOfMemory(trainer.model, max_rows, **fake) if max_rows is not None else None
    trainer.train()
    return trainer, watcher


@pytest.mark.parametrize("in_backward", [False, True])
def test_the_step_runs_again_at_half_until_it_fits(make_trainer, in_backward):
    reference, _ = run(make_trainer, micro_batch_size=2)
    trainer, watcher = run(make_trainer, micro_batch_size=8, max_rows=3, in_backward=in_backward)
    assert watcher.sizes[:6] == [8, 4, 2, 2, 2, 2]
    assert watcher.raised == [8, 4]
    assert watcher.sizes[6:] == [2] * 12  # the next three steps start at the size that ran
    micro = [log["adaptive_batch/micro_batch_size"] for log in trainer.state.log_history if "loss" in log]
    assert micro == [2, 2, 2, 2]
    assert_close_parameters(parameters(trainer.model), parameters(reference.model), rtol=1e-12)


def test_a_late_out_of_memory_shrinks_from_there_on(make_trainer):
    reference, _ = run(make_trainer, micro_batch_size=4)
    trainer, watcher = run(make_trainer, micro_batch_size=8, max_rows=7, only_after_calls=2)
    assert watcher.sizes == [8, 8, 8, 4, 4, 4, 4]  # steps 1-2 at 8; step 3 fails at 8, runs as 4+4; step 4
    assert watcher.raised == [8]
    assert trainer.state.global_step == 4
    assert_close_parameters(parameters(trainer.model), parameters(reference.model), rtol=1e-9)


def test_growth_stops_below_the_size_that_ran_out(make_trainer):
    trainer = make_trainer(
        [AdaptiveBatch()], num_rows=64, per_device_train_batch_size=1, gradient_accumulation_steps=16
    )
    watcher = FakeOutOfMemory(trainer.model, max_rows=5)
    trainer.train()
    controller = trainer._adaptive_batch.controller
    assert watcher.raised == [8]
    assert 8 in controller.oom_sizes and controller.size <= 4 and not controller.exploring
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
