"""Invariant 4: interrupt at any step and resume; the rest of the run is identical."""

import json

import pytest
import torch

from adaptive_batch import AdaptiveBatch, PhaseSchedule

SCHEDULE = PhaseSchedule([4, 8], boundaries=[0.4])


def run(make_trainer, output_dir, micro_batch_size, resume=None, **overrides):
    trainer = make_trainer(
        [AdaptiveBatch(schedule=SCHEDULE, micro_batch_size=micro_batch_size)],
        num_rows=44,
        num_train_epochs=2,
        save_strategy="steps",
        save_steps=1,
        output_dir=str(output_dir),
        dtype=torch.float64,
        **overrides,
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def comparable(logs, after_step):
    keep = ("loss", "learning_rate", "grad_norm", "epoch", "step")
    return [
        {k: v for k, v in log.items() if k in keep or k.startswith("adaptive_batch/")}
        for log in logs
        if "loss" in log and log["step"] > after_step
    ]


@pytest.mark.parametrize("stop_at", [3, 9, 12])
def test_resume_reproduces_the_uninterrupted_run_bitwise(make_trainer, tmp_path, stop_at):
    full = run(make_trainer, tmp_path / "full", micro_batch_size=3)
    resumed = run(
        make_trainer, tmp_path / "resumed", 3, resume=str(tmp_path / "full" / f"checkpoint-{stop_at}")
    )
    assert resumed.state.global_step == full.state.global_step
    for (name, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name
    assert comparable(resumed.state.log_history, stop_at) == comparable(full.state.log_history, stop_at)


def test_the_learned_micro_batch_lives_in_the_checkpoint(make_trainer, tmp_path):
    full = run(
        make_trainer,
        tmp_path / "full",
        micro_batch_size="auto",
        per_device_train_batch_size=1,
        restore_callback_states_from_checkpoint=True,
    )
    checkpoint = tmp_path / "full" / "checkpoint-6"
    saved = json.loads((checkpoint / "trainer_state.json").read_text())["stateful_callbacks"]["AdaptiveBatch"]
    saved = saved["attributes"]["checkpoint"]
    resumed = make_trainer(
        [AdaptiveBatch(schedule=SCHEDULE)],
        num_rows=44,
        num_train_epochs=2,
        output_dir=str(tmp_path / "r"),
        per_device_train_batch_size=1,
        restore_callback_states_from_checkpoint=True,
        dtype=torch.float64,
    )
    restored = {}
    original_restore = resumed._adaptive_batch.restore

    def spy(stored):
        original_restore(stored)
        restored.update(resumed._adaptive_batch.state_dict())

    resumed._adaptive_batch.restore = spy
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert restored["micro_batch"] == saved["micro_batch"]
    assert restored["tokens_seen"] == saved["tokens_seen"] > 0
    assert any(
        isinstance(cb, AdaptiveBatch) and cb.session is resumed._adaptive_batch
        for cb in resumed.callback_handler.callbacks
    )
    final = [log for log in resumed.state.log_history if "loss" in log][-1]
    assert (
        final["adaptive_batch/tokens_seen"]
        == [log for log in full.state.log_history if "loss" in log][-1]["adaptive_batch/tokens_seen"]
    )
    for a, b in zip(full.model.parameters(), resumed.model.parameters()):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-12)


def test_resuming_under_a_different_plan_is_refused(make_trainer, tmp_path):
    run(make_trainer, tmp_path / "full", micro_batch_size=4)
    other = make_trainer(
        [AdaptiveBatch(schedule=PhaseSchedule([4, 12], boundaries=[0.4]))],
        num_rows=44,
        num_train_epochs=2,
        output_dir=str(tmp_path / "other"),
    )
    with pytest.raises(ValueError, match="different step plan"):
        other.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-5"))
