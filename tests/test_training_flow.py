"""Budget, learning rate (invariant 5), epochs, evaluation and saving, and the logged metrics."""

import math

import pytest
import torch
from helpers import adaptive_of, logged, step_logs
from transformers import EarlyStoppingCallback
from transformers.optimization import get_scheduler

from adaptive_batch import AdaptiveBatch, PhaseSchedule

KEYS = [
    "adaptive_batch/effective_batch_size",
    "adaptive_batch/micro_batch_size",
    "adaptive_batch/accumulation_steps",
    "adaptive_batch/samples_seen",
    "adaptive_batch/tokens_seen",
    "adaptive_batch/lr_scale",
]


@pytest.mark.parametrize(
    "scheduler_type", ["linear", "cosine", "constant_with_warmup", "warmup_stable_decay"]
)
def test_learning_rate_is_the_base_schedule_at_the_sample_fraction_times_the_rule(
    make_trainer, scheduler_type
):
    schedule = PhaseSchedule([4, 8, 16], boundaries=[0.25, 0.5])
    specific = {"num_decay_steps": 4} if scheduler_type == "warmup_stable_decay" else {}
    trainer = make_trainer(
        [AdaptiveBatch(schedule=schedule, lr_scaling="sqrt", micro_batch_size=4)],
        num_rows=60,
        num_train_epochs=2,
        lr_scheduler_type=scheduler_type,
        warmup_steps=5,
        learning_rate=1e-3,
        lr_scheduler_kwargs=specific,
    )
    trainer.train()
    plan = adaptive_of(trainer).plan
    nominal = math.ceil(120 / 4)
    reference = get_scheduler(
        scheduler_type,
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0),
        num_warmup_steps=5,
        num_training_steps=nominal,
        scheduler_specific_kwargs=specific,
    )
    logs = step_logs(trainer)
    # 4 to a quarter of the 120 samples, 8 to half (epoch 1 ends with 4 of 8), then 16 (epoch 2 ends with 12)
    sizes = [log["adaptive_batch/effective_batch_size"] for log in logs]
    assert sizes == list(plan.sizes) == [4] * 8 + [8, 8, 8, 4] + [16, 16, 16, 12]
    for step, log in enumerate(logs):
        fraction = plan.starts[step] / plan.budget
        scale = math.sqrt(sizes[step] / 4)  # the rule applies to the samples the step holds
        expected = 1e-3 * reference.lr_lambdas[0](fraction * nominal) * scale
        assert log["learning_rate"] == pytest.approx(expected, rel=1e-9, abs=1e-15), step
        assert log["adaptive_batch/lr_scale"] == pytest.approx(scale)


def test_a_shrinking_batch_keeps_the_sample_clock_the_rule_and_the_budget(make_trainer):
    # 16 to a quarter of the 128 samples, 8 to half (the end of epoch 1), then 4: LR x sqrt(B / 16) below 1
    trainer = make_trainer(
        [AdaptiveBatch(schedule=PhaseSchedule([16, 8, 4], boundaries=[0.25, 0.5]), lr_scaling="sqrt")],
        num_rows=64,
        num_train_epochs=2,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=1,
        lr_scheduler_type="linear",
        warmup_steps=2,
        learning_rate=1e-3,
    )
    trainer.train()
    plan = adaptive_of(trainer).plan
    logs = step_logs(trainer)
    sizes = [log["adaptive_batch/effective_batch_size"] for log in logs]
    assert sizes == list(plan.sizes) == [16, 16] + [8] * 4 + [4] * 16
    assert [log["adaptive_batch/samples_seen"] for log in logs][5::16] == [64, 128]
    assert [log["epoch"] for log in logs][5::16] == [1.0, 2.0]
    nominal = 2 * 64 // 16  # the plain Trainer's 8 steps of 16
    reference = get_scheduler(
        "linear",
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0),
        num_warmup_steps=2,
        num_training_steps=nominal,
    )
    for step, log in enumerate(logs):
        scale = math.sqrt(sizes[step] / 16)
        expected = 1e-3 * reference.lr_lambdas[0](plan.starts[step] / 16) * scale
        assert log["learning_rate"] == pytest.approx(expected, rel=1e-9, abs=1e-15), step
        assert log["adaptive_batch/lr_scale"] == pytest.approx(scale)


def test_max_steps_under_a_shrinking_batch_is_the_same_sample_budget_and_the_warning_says_so(
    make_trainer, caplog
):
    trainer = make_trainer(
        [AdaptiveBatch(schedule=PhaseSchedule([8, 4], boundaries=[0.5]))], num_rows=400, max_steps=10
    )
    with caplog.at_level("INFO", logger="adaptive_batch"):
        trainer.train()
    assert logged(trainer, "adaptive_batch/samples_seen")[-1] == 10 * 8
    assert trainer.state.global_step == 5 + 10  # 40 samples at 8, then 40 at 4
    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("max_steps=10 with")]
    assert warnings == [
        "max_steps=10 with a shrinking batch (8 -> 4): AdaptiveBatch counts it as 80 samples (10 steps of 8) and "
        "runs 15 optimizer steps; the plain Trainer would run 10 steps of the scheduled batches, 60 samples. To train "
        "on fewer samples, lower max_steps (in steps of the starting batch) or give the budget in num_train_epochs."
    ]


def test_a_short_last_step_says_whether_the_epoch_or_the_budget_ended(make_trainer):
    # max_steps=6 x 4 samples = 24 of 40: the budget ends inside the epoch, in the middle of a step of 8
    callback = AdaptiveBatch(schedule=PhaseSchedule([4, 8], boundaries=[0.5]))
    make_trainer([callback], num_rows=40, per_device_train_batch_size=4, max_steps=6)
    table = dict(callback.plan_table())
    assert (
        table["uneven steps"] == "step 5: 4 of 8 (the budget's rest; LR x1)"
    )  # numbered as the Trainer logs


def test_a_short_step_gets_the_learning_rate_of_the_samples_it_holds(make_trainer, caplog):
    trainer = make_trainer(
        [AdaptiveBatch(schedule=PhaseSchedule([8, 16], boundaries=[0.5]), lr_scaling="linear")],
        num_rows=40,
        num_train_epochs=2,
        lr_scheduler_type="constant",
    )
    with caplog.at_level("INFO", logger="adaptive_batch"):
        trainer.train()
    table = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("AdaptiveBatch plan"))
    assert "  uneven steps   " in table and table.endswith("step 8: 8 of 16 (an epoch's rest; LR x1)")
    assert "phases (steps: effective batch)  1-5: 8, 6-8: 16" in table
    sizes = logged(trainer, "adaptive_batch/effective_batch_size")
    assert sizes == [8] * 5 + [16, 16, 8]  # epoch 2: 40 samples at 16, the last step holds 8
    assert logged(trainer, "step")[7] == 8  # the step the table names is the one the Trainer logs as 8
    assert logged(trainer, "adaptive_batch/lr_scale") == [size / 8 for size in sizes]
    assert logged(trainer, "learning_rate") == [1e-2 * size / 8 for size in sizes]


def test_one_instance_serves_several_trainers_in_turn(make_trainer):
    callback = AdaptiveBatch(micro_batch_size=4)
    first = make_trainer([callback], num_rows=32)
    first.train()
    second = make_trainer(
        [callback], num_rows=64, per_device_train_batch_size=2, gradient_accumulation_steps=4
    )
    second.train()
    assert logged(second, "adaptive_batch/effective_batch_size") == [8] * 8
    assert logged(second, "adaptive_batch/micro_batch_size") == [4] * 8
    assert logged(second, "epoch") == [(k + 1) / 8 for k in range(8)]
    assert callback.session.trainer is second
    first.train()  # the first Trainer again, with its own plan
    assert logged(first, "adaptive_batch/samples_seen") == [8, 16, 24, 32]
    assert logged(first, "epoch") == [0.25, 0.5, 0.75, 1.0]


def test_max_steps_is_a_sample_budget_when_the_batch_grows(make_trainer):
    trainer = make_trainer(
        [AdaptiveBatch(schedule=PhaseSchedule([8, 32], boundaries=[0.5]))],
        num_rows=400,
        max_steps=20,
    )
    trainer.train()
    logs = step_logs(trainer)
    assert logs[-1]["adaptive_batch/samples_seen"] == 20 * 8
    assert trainer.state.global_step == 10 + 3  # 80 samples at 8, then 80 at 32: 2 full steps and 16 left
    assert [log["adaptive_batch/effective_batch_size"] for log in logs[-3:]] == [32, 32, 16]


def test_every_logged_step_carries_the_metrics_and_they_add_up(make_trainer, rows):
    trainer = make_trainer([AdaptiveBatch(micro_batch_size=3)], num_rows=44, num_train_epochs=2)
    trainer.train()
    logs = step_logs(trainer)
    assert all(all(key in log for key in KEYS) for log in logs)
    assert [log["adaptive_batch/effective_batch_size"] for log in logs] == [8, 8, 8, 8, 8, 4] * 2
    assert [log["adaptive_batch/accumulation_steps"] for log in logs] == [3, 3, 3, 3, 3, 2] * 2
    assert [log["adaptive_batch/samples_seen"] for log in logs] == [
        8,
        16,
        24,
        32,
        40,
        44,
        52,
        60,
        68,
        76,
        84,
        88,
    ]
    assert logs[-1]["adaptive_batch/tokens_seen"] == 2 * sum(len(r["input_ids"]) for r in rows[:44])
    assert [log["epoch"] for log in logs][5::6] == [1.0, 2.0]


def test_epochs_end_with_one_evaluation_and_one_checkpoint_each(make_trainer, rows, tmp_path):
    trainer = make_trainer(
        [AdaptiveBatch(schedule=PhaseSchedule([4, 8], boundaries=[0.5]))],
        num_rows=36,
        num_train_epochs=3,
        eval_strategy="epoch",
        save_strategy="epoch",
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        eval_dataset=rows[100:116],
        save_total_limit=5,
    )
    trainer.train()
    evals = [log for log in trainer.state.log_history if "eval_loss" in log]
    assert [log["epoch"] for log in evals] == [1.0, 2.0, 3.0]
    plan = adaptive_of(trainer).plan
    epoch_ends = [k + 1 for k in range(plan.num_steps) if plan.ends_epoch(k)]
    assert [log["step"] for log in evals] == epoch_ends
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "out").glob("checkpoint-*"))
    assert saved == epoch_ends
    assert trainer.state.best_model_checkpoint.endswith(f"checkpoint-{trainer.state.best_global_step}")
    assert trainer.state.epoch == 3.0 and trainer.state.num_train_epochs == 3


def test_early_stopping_and_best_model_work_as_in_the_plain_trainer(make_trainer, rows):
    trainer = make_trainer(
        [AdaptiveBatch(), EarlyStoppingCallback(early_stopping_patience=1, early_stopping_threshold=10.0)],
        num_rows=32,
        num_train_epochs=5,
        eval_strategy="epoch",
        save_strategy="epoch",
        load_best_model_at_end=True,
        eval_dataset=rows[100:108],
    )
    trainer.train()
    evals = [log for log in trainer.state.log_history if "eval_loss" in log]
    assert [log["epoch"] for log in evals] == [1.0, 2.0]  # no eval improves by 10: stop after the second
    assert trainer.state.global_step == 8


def test_attach_after_construction(make_trainer):
    trainer = make_trainer(num_rows=24)
    callback = AdaptiveBatch.attach(trainer, micro_batch_size=2)
    assert isinstance(callback, AdaptiveBatch) and callback in trainer.callback_handler.callbacks
    trainer.train()
    assert {log["adaptive_batch/micro_batch_size"] for log in step_logs(trainer)} == {2}
    other = make_trainer(num_rows=24)
    attached = AdaptiveBatch(schedule=4).attach(other)
    other.train()
    assert {log["adaptive_batch/effective_batch_size"] for log in step_logs(other)} == {4}
    assert attached.session.trainer is other


def test_drop_last_drops_each_epochs_short_step_and_epochs_still_end_on_whole_numbers(make_trainer, rows):
    trainer = make_trainer(
        [AdaptiveBatch()],
        num_rows=44,
        num_train_epochs=2,
        dataloader_drop_last=True,
        eval_strategy="epoch",
        eval_dataset=rows[100:108],  # one whole evaluation batch: drop_last drops short ones there too
    )
    trainer.train()
    logs = step_logs(trainer)
    assert [log["adaptive_batch/effective_batch_size"] for log in logs] == [8] * 10
    assert logs[-1]["adaptive_batch/samples_seen"] == 80
    assert [log["epoch"] for log in trainer.state.log_history if "eval_loss" in log] == [1.0, 2.0]


def test_the_callback_class_itself_is_accepted(make_trainer):
    trainer = make_trainer([AdaptiveBatch], num_rows=16)
    trainer.train()
    assert step_logs(trainer)[-1]["adaptive_batch/samples_seen"] == 16


def test_the_plan_table_is_logged_when_training_starts(make_trainer, rows, caplog):
    from datasets import Dataset

    trainer = make_trainer(
        [AdaptiveBatch(schedule=PhaseSchedule([4, 8], boundaries=[0.5]))],
        dataset=Dataset.from_list(rows[:40]),
        num_train_epochs=2,
    )
    with caplog.at_level("INFO", logger="adaptive_batch"):
        trainer.train()
    table = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("AdaptiveBatch plan"))
    tokens = 2 * sum(len(r["input_ids"]) for r in rows[:40])
    assert f"tokens                           {tokens:,} (non-padding)" in table
    assert "optimizer steps                  15 (the plain Trainer: 10)" in table
    assert "effective batch                  4 -> 8 (phases start at 0.5 fraction)" in table
    assert "samples                          80 from num_train_epochs=2 x 40 samples" in table


def test_the_plan_table_lists_where_evaluation_and_saving_by_steps_happen_under_a_growing_batch(
    make_trainer, rows, tmp_path
):
    """The steps the table lists are the ones the Trainer evaluates and saves at, with and without AdaptiveBatch."""
    settings = dict(
        num_rows=40,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        eval_strategy="steps",
        eval_steps=4,
        save_strategy="steps",
        save_steps=4,
        eval_dataset=rows[100:104],
    )
    callback = AdaptiveBatch(schedule=PhaseSchedule([2, 4], boundaries=[0.5]))
    trainer = make_trainer([callback], **settings)
    table = dict(callback.plan_table())
    trainer.train()
    plan = callback.plan
    assert list(plan.sizes) == [2] * 10 + [4] * 5
    evaluated = [log["step"] for log in trainer.state.log_history if "eval_loss" in log]
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "out").glob("checkpoint-*"))
    assert evaluated == saved == [4, 8, 12, 15]
    samples = [plan.samples_before_step[step] for step in evaluated]
    assert samples == [8, 16, 28, 40]
    plain = make_trainer(output_dir=str(tmp_path / "plain"), **settings)
    plain.train()
    plain_evaluated = [log["step"] for log in plain.state.log_history if "eval_loss" in log]
    assert plain_evaluated == [4, 8, 12, 16, 20]
    for what, field in (("evaluation", "eval_steps"), ("saving", "save_steps")):
        verb = "evaluate" if what == "evaluation" else "save"
        assert table[f"{what} by steps"] == (
            f"{field}=4 counts steps of the batch of the time: steps 4, 8, 12, 15 (after 8, 16, 28, 40 samples); the "
            "plain Trainer's: 4, 8, 12, 16, 20 (after 8, 16, 24, 32, 40 samples). To "
            f"{verb} at least every 8 samples, as the plain Trainer does: {field}=2 (8 samples apart at the largest "
            f"batch, 4, more often at smaller ones), or {field.split('_')[0]}_strategy='epoch', which follows data "
            f"epochs (a float {field} is a share of the steps, not of the samples)"
        )
    # at a constant batch the steps are the plain Trainer's: no row
    constant = AdaptiveBatch()
    make_trainer([constant], **settings)
    assert not any(label.endswith("by steps") for label, _ in constant.plan_table())


def test_the_plan_and_the_run_are_readable_from_python(make_trainer):
    callback = AdaptiveBatch(schedule=PhaseSchedule([4, 8], boundaries=[0.5]), micro_batch_size=2)
    with pytest.raises(RuntimeError, match=r"AdaptiveBatch.plan is known once the Trainer is built"):
        _ = callback.plan
    trainer = make_trainer(callbacks=[callback], num_rows=40)
    plan = callback.plan
    assert list(plan.sizes) == [4] * 5 + [8, 8, 4] and plan.num_samples == 40
    table = dict(callback.plan_table())
    assert table["optimizer steps"].startswith("8") and table["world size"] == "1"
    before = callback.current()
    assert (before["step"], before["effective_batch_size"], before["samples_seen"]) == (0, 4, 0)
    trainer.train()
    now = callback.current()
    assert now["step"] == trainer.state.global_step == plan.num_steps
    assert (
        now["samples_seen"] == 40 and now["effective_batch_size"] == 4
    )  # the epoch's last step holds the rest
    assert now["accumulation_steps"] == 2 and now["micro_batch_size"] == 2
    assert now["lr_scale"] == logged(trainer, "adaptive_batch/lr_scale")[-1]
    assert now["tokens_seen"] == logged(trainer, "adaptive_batch/tokens_seen")[-1] > 0
    assert now["micro_batch_settled_because"] == "fixed by micro_batch_size" and now["batch_changes"] == []


def test_before_training_the_micro_batch_is_the_first_steps_own(make_trainer):
    # a fixed 32 over a schedule that starts at 8 samples a step: the first step runs one micro-batch of 8
    callback = AdaptiveBatch(schedule=PhaseSchedule([8, 32], boundaries=[0.5]), micro_batch_size=32)
    trainer = make_trainer([callback], num_rows=64)
    assert callback.current()["micro_batch_size"] == 8
    trainer.train()
    assert logged(trainer, "adaptive_batch/micro_batch_size")[0] == 8
