import math
import time
from collections import Counter

import pytest

from adaptive_batch.core.planning import RunSettings, plan_run
from adaptive_batch.core.schedule import PhaseSchedule, as_schedule
from adaptive_batch.core.steps import Budget, build_plan
from adaptive_batch.runtime.sampler import StepBatchSampler


def test_constant_batch_with_a_short_last_step_per_epoch():
    plan = build_plan(as_schedule(8), dataset_size=20, budget=Budget.from_epochs(2, 20))
    assert list(plan.sizes) == [8, 8, 4, 8, 8, 4]
    assert list(plan.starts) == [0, 8, 16, 20, 28, 36]
    assert [plan.epoch(k) for k in range(plan.num_steps)] == [0, 0, 0, 1, 1, 1]
    assert [plan.epoch_after(k) for k in range(plan.num_steps)] == [0.4, 0.8, 1.0, 1.4, 1.8, 2.0]
    assert [plan.ends_epoch(k) for k in range(plan.num_steps)] == [False, False, True, False, False, True]
    assert plan.num_samples == 40 and plan.num_epochs == 2


def test_drop_last_drops_each_epochs_short_step_but_counts_its_positions():
    plan = build_plan(as_schedule(8), dataset_size=20, budget=Budget.from_epochs(2, 20), drop_last=True)
    assert list(plan.sizes) == [8, 8, 8, 8]
    assert list(plan.starts) == [0, 8, 20, 28]
    assert plan.num_samples == 32
    assert plan.epoch_after(1) == 1.0 and plan.ends_epoch(1)
    assert plan.starts[2] / plan.budget == 0.5  # where the LR clock puts step 2


def test_growing_batch_shortens_the_run_in_steps_not_in_data():
    schedule = PhaseSchedule([4, 8, 16], boundaries=[0.25, 0.5])
    plan = build_plan(schedule, dataset_size=64, budget=Budget.from_epochs(1, 64))
    assert list(plan.sizes) == [4, 4, 4, 4, 8, 8, 16, 16]
    assert plan.num_samples == 64
    assert [plan.scheduled[k] for k in range(plan.num_steps)] == [4, 4, 4, 4, 8, 8, 16, 16]
    assert plan.phases() == [(0, 3, 4), (4, 5, 8), (6, 7, 16)]


def test_max_steps_budget_is_counted_in_samples_of_the_starting_batch():
    budget = Budget.from_max_steps(10, 8)
    assert budget.samples == 80 and "max_steps=10" in budget.origin
    plan = build_plan(PhaseSchedule([8, 16], boundaries=[0.5]), dataset_size=1000, budget=budget)
    assert list(plan.sizes) == [8, 8, 8, 8, 8, 16, 16, 8]  # the last step is cut to the budget
    assert plan.num_samples == 80


def test_a_remainder_smaller_than_the_world_joins_the_step_before():
    plan = build_plan(as_schedule(4), dataset_size=9, budget=Budget.from_epochs(1, 9), world_size=2)
    assert list(plan.sizes) == [4, 5]
    assert [len(StepBatchSampler(plan, seed=0, rank=r).indices(1)) for r in (0, 1)] == [3, 2]
    assert plan.max_rows(1) == 3


def test_fractional_epochs_cut_the_last_step_to_the_budget():
    plan = build_plan(as_schedule(8), dataset_size=20, budget=Budget.from_epochs(1.5, 20))
    assert plan.budget == 30
    assert list(plan.sizes) == [8, 8, 4, 8, 2]


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_position_of_the_budget_is_used_once(world_size, drop_last):
    schedule = PhaseSchedule([world_size * 2, world_size * 3, world_size * 7], boundaries=[0.2, 0.6])
    plan = build_plan(
        schedule,
        dataset_size=53,
        budget=Budget.from_epochs(3, 53),
        world_size=world_size,
        drop_last=drop_last,
    )
    covered = Counter()
    for k in range(plan.num_steps):
        start, size = plan.starts[k], plan.sizes[k]
        assert start // 53 == (start + size - 1) // 53, "a step straddles two epochs"
        assert size >= world_size
        covered.update(range(start, start + size))
    assert max(covered.values()) == 1
    if not drop_last:
        assert sorted(covered) == list(range(3 * 53))
    assert plan.num_samples == sum(plan.sizes) == plan.samples_before_step[-1]


def test_effective_batch_not_divisible_by_the_world_names_the_value_and_a_fix():
    with pytest.raises(
        ValueError, match=r"effective batch 48 .* not divisible by world_size=5.*Use 45 or 50"
    ):
        build_plan(as_schedule(48), dataset_size=1000, budget=1000, world_size=5)


def test_schedule_errors_name_the_step_where_they_occur():
    schedule = PhaseSchedule([8, 20], boundaries=[3], unit="steps")
    with pytest.raises(ValueError, match=r"effective batch 20 at step 3 .* exceeds the dataset size 16"):
        build_plan(schedule, dataset_size=16, budget=64)
    with pytest.raises(ValueError, match=r"step 2 .* effective batch 0"):
        build_plan(lambda p: 8 if p.step < 2 else 0, dataset_size=100, budget=100)
    with pytest.raises(ValueError, match=r"effective batch 7.5"):
        build_plan(lambda p: 7.5, dataset_size=100, budget=100)


def test_dataset_smaller_than_the_world_is_rejected():
    with pytest.raises(ValueError, match="3 samples but world_size=4"):
        build_plan(as_schedule(4), dataset_size=3, budget=3, world_size=4)


def test_budget_errors():
    with pytest.raises(ValueError, match="num_train_epochs=0 must be positive"):
        Budget.from_epochs(0, 10)
    with pytest.raises(ValueError, match="budget is 0 samples"):
        build_plan(as_schedule(4), dataset_size=10, budget=0)


def test_fingerprint_changes_with_the_cut_and_not_otherwise():
    a = build_plan(as_schedule(8), dataset_size=40, budget=80)
    b = build_plan(as_schedule(8), dataset_size=40, budget=80, world_size=2)
    c = build_plan(as_schedule(4), dataset_size=40, budget=80)
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()


def test_a_long_plan_builds_in_time_linear_in_its_steps():
    # 250,020 steps take about 0.8 s on a 2-core CI machine; a cost quadratic in the steps would take hours
    started = time.perf_counter()
    plan = build_plan(as_schedule(8), dataset_size=100_003, budget=Budget.from_epochs(20, 100_003))
    plan.fingerprint(), plan.phases(), plan.uneven_steps()
    assert time.perf_counter() - started < 30
    assert plan.num_steps == 20 * math.ceil(100_003 / 8)


def test_steps_done_before_the_plan_took_over_come_first():
    from adaptive_batch.core.plain_trainer import PlainBatching

    # the plain Trainer's 8 x 1 on 20 samples: steps of 8, 8, 4 each epoch; 4 of them done (one epoch and a step)
    done = PlainBatching(20, 8, 1).done_steps(4)
    assert done == ([0, 8, 16, 20], [8, 8, 4, 8], 28, 8)
    plan = build_plan(PhaseSchedule([8, 12], boundaries=[0.5]), dataset_size=20, budget=40, done=done)
    assert plan.done_steps == 4
    assert list(plan.sizes) == [8, 8, 4, 8, 12]  # from position 28 of 40 (fraction 0.7): one step of 12
    assert list(plan.starts)[4:] == [28] and plan.num_samples == 40
    assert plan.phases() == [(4, 4, 12)] and plan.uneven_steps() == []
    with pytest.raises(ValueError, match="already used 40 of the budget's 40 samples"):
        build_plan(as_schedule(8), dataset_size=20, budget=40, done=PlainBatching(20, 8, 1).done_steps(6))


def test_the_plain_trainers_steps_with_accumulation_ranks_and_drop_last():
    from adaptive_batch.core.plain_trainer import PlainBatching

    # 44 samples, 4 per device, accumulation 2, 2 ranks: 11 batches, 6 per rank, 3 steps of 16, 16, 12
    plain = PlainBatching(44, 4, 2, world_size=2)
    assert plain.steps_per_epoch == 3 and plain.step_sizes(4) == [16, 16, 12, 16]
    assert plain.position_after(3) == 44 and plain.position_after(4) == 60
    assert plain.total_steps(num_train_epochs=2.5) == 8 and plain.total_steps(2, max_steps=5) == 5
    dropped = PlainBatching(44, 8, 1, drop_last=True)  # 5 whole batches, the last 4 samples dropped
    assert dropped.steps_per_epoch == 5 and dropped.position_after(5) == 44


def test_step_strategy_rows_say_what_a_noise_schedule_or_a_shrinking_batch_does_to_eval_steps():
    from adaptive_batch.core.report import StepStrategy, step_strategy_rows

    evaluation = [StepStrategy("evaluation", "eval_steps", "eval_strategy", 4)]
    constant = plan_run(as_schedule(8), RunSettings(400, 1, per_device_train_batch_size=8))
    plain = constant.settings.plain_trainer(8)
    assert step_strategy_rows(constant.plan, plain, 50, evaluation) == []  # a constant batch: the plain steps
    # a NoiseScaleSchedule's changes are not known before training: the row says so, with the fix at its max_size
    [(label, text)] = step_strategy_rows(constant.plan, plain, 50, evaluation, may_grow_to=16)
    assert label == "evaluation by steps" and text == (
        "eval_steps=4 counts steps of the batch of the time: the plain Trainer's steps (every 32 samples) until the "
        "batch grows (decided while training, up to 16), more samples apart after. To evaluate at least every 32 "
        "samples, as the plain Trainer does: eval_steps=2 (32 samples apart at the largest batch, 16, more often at "
        "smaller ones), or eval_strategy='epoch', which follows data epochs (a float eval_steps is a share of the "
        "steps, not of the samples)"
    )
    shrinking = plan_run(PhaseSchedule([8, 4], [0.5]), RunSettings(64, 1, per_device_train_batch_size=8))
    [(_, text)] = step_strategy_rows(shrinking.plan, shrinking.settings.plain_trainer(8), 8, evaluation)
    assert text.startswith(
        "eval_steps=4 counts steps of the batch of the time: steps 4, 8, 12 (after 32, 48, 64 samples); the plain "
        "Trainer's: 4, 8 (after 32, 64 samples)"
    )
    assert text.endswith(
        "it still evaluates at least every 32 samples, the plain Trainer's interval (more often at "
        "the smaller batches)"
    )
