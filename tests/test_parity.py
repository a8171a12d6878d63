"""Parity with the plain Trainer: what the user did not ask to change stays as the plain Trainer has it (its steps,
epochs, checkpoints, learning rate and samples), and a checkpoint moves between the two."""

import pytest
from helpers import ORDER_ONLY, Recording, assert_close_parameters, parameters, step_logs

from adaptive_batch import AdaptiveBatch, PhaseSchedule

RUN = dict(num_rows=60, per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=1e-2)


def samples_per_step(trainer) -> list[list[tuple[int, ...]]]:
    """The rows (their tokens) each optimizer step trained on, sorted: what a step took, whatever its cut."""
    steps: dict[int, list] = {}
    for step, _, _, _, content in trainer.micro_batches:
        steps.setdefault(step, []).extend(content)
    return [sorted(steps[k]) for k in sorted(steps)]


def saved_steps(path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in path.glob("checkpoint-*"))


@pytest.mark.parametrize(
    "budget",
    [
        dict(max_steps=10),  # 60 rows at 8: 7 steps of 8 and one of 4 an epoch, then 2 steps into the second
        dict(num_train_epochs=1.5),  # 1.5 x 8 steps an epoch = 12, as the plain Trainer rounds it
        dict(num_train_epochs=2, lr_scheduler_type="cosine", warmup_steps=3),
    ],
)
def test_a_constant_batch_runs_the_plain_trainers_steps_epochs_checkpoints_lr_and_samples(
    make_trainer, tmp_path, budget
):
    def run(callbacks, name):
        trainer = make_trainer(
            callbacks,
            trainer_class=Recording,
            save_strategy="steps",
            save_steps=5,
            output_dir=str(tmp_path / name),
            **RUN,
            **budget,
        )
        trainer.train()
        return trainer

    plain = run([], "plain")
    adaptive = AdaptiveBatch(micro_batch_size=4)
    ours = run([adaptive], "adaptive")
    assert ours.state.global_step == plain.state.global_step
    assert ours.state.epoch == plain.state.epoch
    assert saved_steps(tmp_path / "adaptive") == saved_steps(tmp_path / "plain")
    # the learning rate of every step, bit for bit
    assert [log["learning_rate"] for log in step_logs(ours)] == [
        log["learning_rate"] for log in step_logs(plain)
    ]
    assert samples_per_step(ours) == samples_per_step(plain)
    steps = dict(adaptive.plan_table())["optimizer steps"]
    assert steps == f"{plain.state.global_step:,}"  # no "(the plain Trainer: ...)": the same


def test_a_growing_batch_takes_the_samples_of_the_plain_trainers_max_steps(make_trainer):
    # the plain Trainer's 10 steps at 8 take 76 samples (an epoch's short last step counts as one step)
    adaptive = AdaptiveBatch(schedule=PhaseSchedule([8, 16], boundaries=[0.5]))
    make_trainer([adaptive], max_steps=10, **RUN)
    plan = adaptive.plan
    assert plan.num_samples == 76 and plan.num_steps < 10
    origin = dict(adaptive.plan_table())["samples"]
    assert origin.startswith(
        "76 from max_steps=10 steps of the plain Trainer at the starting effective batch 8"
    )


def test_a_checkpoint_written_with_the_plugin_resumes_in_a_plain_trainer(make_trainer, tmp_path):
    # leaving the plugin: the plain Trainer loads its scheduler and goes on at the same step, LR and samples
    settings = dict(
        RUN,
        **{**ORDER_ONLY, "learning_rate": 0.05},
        num_train_epochs=2,
        trainer_class=Recording,
        save_strategy="steps",
        save_steps=5,
    )
    whole = make_trainer(output_dir=str(tmp_path / "whole"), **settings)
    whole.train()
    with_plugin = make_trainer(
        [AdaptiveBatch(micro_batch_size=4)], output_dir=str(tmp_path / "ours"), **settings
    )
    with_plugin.train()
    left = make_trainer(output_dir=str(tmp_path / "left"), **settings)
    left.train(resume_from_checkpoint=str(tmp_path / "ours" / "checkpoint-5"))

    def after(trainer, key):
        return [log[key] for log in step_logs(trainer) if log["step"] > 5]

    assert left.state.global_step == whole.state.global_step == 16
    assert after(left, "learning_rate") == after(whole, "learning_rate")
    assert samples_per_step(left) == samples_per_step(whole)[5:]
    # the first five steps were cut otherwise (longest rows first): the same sums, in another order
    assert_close_parameters(parameters(left.model), parameters(whole.model))


def test_a_checkpoint_a_plain_trainer_would_resume_elsewhere_makes_it_fail_with_the_reason(
    make_trainer, tmp_path
):
    # 60 rows, 2 epochs at 8 (8 steps an epoch, the last of 4), then 16 from the second epoch: 12 steps
    settings = dict(
        RUN,
        **{**ORDER_ONLY, "learning_rate": 0.05},
        num_train_epochs=2,
        trainer_class=Recording,
        save_strategy="steps",
        save_steps=2,
    )
    ours = make_trainer(
        [AdaptiveBatch(schedule=PhaseSchedule([8, 16], boundaries=[0.5]), micro_batch_size=4)],
        output_dir=str(tmp_path / "ours"),
        **settings,
    )
    ours.train()
    assert ours.state.global_step == 12

    # checkpoint-10: ten steps took 60 + 2 x 16 = 92 samples; a plain Trainer's ten steps of 8 take 76
    left = make_trainer(output_dir=str(tmp_path / "left"), **settings)
    with pytest.raises(TypeError) as refused:
        left.train(resume_from_checkpoint=str(tmp_path / "ours" / "checkpoint-10"))
    message = str(refused.value)
    assert "a Trainer without AdaptiveBatch would resume this checkpoint at the wrong sample" in message
    assert (
        "its 10 optimizer steps took 92 samples, where the plain Trainer's 10 steps of 8 take 76" in message
    )
    assert "Resume it with callbacks=[AdaptiveBatch(...)]" in message
    assert left.state.global_step == 0 and not getattr(left, "micro_batches", [])  # refused before training

    # AdaptiveBatch itself resumes it: the last two steps, as the whole run had them
    again = make_trainer(
        [AdaptiveBatch(schedule=PhaseSchedule([8, 16], boundaries=[0.5]), micro_batch_size=4)],
        output_dir=str(tmp_path / "again"),
        **settings,
    )
    again.train(resume_from_checkpoint=str(tmp_path / "ours" / "checkpoint-10"))
    assert samples_per_step(again) == samples_per_step(ours)[10:]
    assert_close_parameters(parameters(again.model), parameters(ours.model))

    # checkpoint-4, before the batch grew: the plain Trainer's own steps, so no refusal; it goes on as the plain run
    whole = make_trainer(output_dir=str(tmp_path / "whole"), **settings)
    whole.train()
    plain = make_trainer(output_dir=str(tmp_path / "plain"), **settings)
    plain.train(resume_from_checkpoint=str(tmp_path / "ours" / "checkpoint-4"))
    after = [log["learning_rate"] for log in step_logs(plain) if log["step"] > 4]
    assert after == [log["learning_rate"] for log in step_logs(whole) if log["step"] > 4]
    assert samples_per_step(plain) == samples_per_step(whole)[4:]


def test_a_plain_checkpoint_taken_over_mid_epoch_trains_the_rest_of_the_epoch_exactly(make_trainer, tmp_path):
    # taking the plugin up: AdaptiveBatch draws each epoch's permutation as the plain Trainer's seedable sampler does
    settings = dict(RUN, num_train_epochs=1, trainer_class=Recording, save_strategy="steps", save_steps=3)
    plain = make_trainer(output_dir=str(tmp_path / "plain"), **settings)
    plain.train()
    adopted = make_trainer(
        [AdaptiveBatch(micro_batch_size=3)], output_dir=str(tmp_path / "adopted"), **settings
    )
    adopted.train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-3"))
    first, rest = samples_per_step(plain)[:3], samples_per_step(adopted)
    assert rest == samples_per_step(plain)[3:]
    assert sorted(row for step in first + rest for row in step) == sorted(
        tuple(row["input_ids"]) for row in plain.train_dataset
    )  # every sample of the epoch once


def test_a_missing_checkpoint_folder_fails_with_the_trainers_own_sentence(make_trainer, tmp_path):
    missing = str(tmp_path / "checkpoint-7")
    for callbacks in ([], [AdaptiveBatch()]):
        with pytest.raises(ValueError, match=f"^Can't find a valid checkpoint at {missing}"):
            make_trainer(callbacks).train(resume_from_checkpoint=missing)


@pytest.mark.parametrize("micro_batch_size", [4, "auto"])
def test_a_step_larger_than_the_dataset_trains_an_epoch_a_step_as_the_plain_trainer(
    make_trainer, tmp_path, caplog, micro_batch_size
):
    # 16 x 5 = 80 samples a step over 36 rows: the plain Trainer's step is the epoch's 3 batches of 16, 16 and 4
    def run(callbacks, name):
        settings = dict(
            num_rows=36, per_device_train_batch_size=16, gradient_accumulation_steps=5, **ORDER_ONLY
        )
        trainer = make_trainer(callbacks, num_train_epochs=3, output_dir=str(tmp_path / name), **settings)
        trainer.train()
        return trainer

    plain = run([], "plain")
    ours = run([AdaptiveBatch(micro_batch_size=micro_batch_size)], "adaptive")
    assert ours.state.global_step == plain.state.global_step == 3
    assert ours.state.epoch == plain.state.epoch == 3
    assert_close_parameters(parameters(ours.model), parameters(plain.model))
    assert [log["loss"] for log in step_logs(ours)] == pytest.approx(
        [log["loss"] for log in step_logs(plain)]
    )
    assert "each optimizer step takes one whole epoch (36), as the plain Trainer's does" in caplog.text
