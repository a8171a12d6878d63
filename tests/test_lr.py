import math

import pytest

from adaptive_batch.core.lr import SampleClock, lr_scale, resolve_rule
from adaptive_batch.core.planning import RunSettings, plan_run
from adaptive_batch.core.schedule import PhaseSchedule, as_schedule
from adaptive_batch.core.steps import build_plan


@pytest.mark.parametrize("rule, expected", [("none", 1.0), ("sqrt", 2.0), ("linear", 4.0)])
def test_named_rules(rule, expected):
    assert lr_scale(resolve_rule(rule), 32, 8) == expected


def test_callable_rule_and_bad_rules():
    assert lr_scale(resolve_rule(lambda b, b0: (b / b0) ** 0.25), 128, 8) == 2.0
    with pytest.raises(ValueError, match="lr_scaling='cubic' is not one of"):
        resolve_rule("cubic")
    for bad in (0.0, -1.0, float("nan"), float("inf"), "2", None):
        with pytest.raises(ValueError, match="positive finite float"):
            lr_scale(resolve_rule(lambda b, b0, bad=bad: bad), 16, 8)


@pytest.mark.parametrize("dataset_size, epochs", [(800, 1), (60, 2.5), (61, 3)])
def test_virtual_step_is_the_step_itself_for_a_constant_batch(dataset_size, epochs):
    # also where each epoch ends with a short step (60 = 7 x 8 + 4): it counts as one, as the plain Trainer counts
    run = plan_run(as_schedule(8), RunSettings(dataset_size, num_train_epochs=epochs), "sqrt")
    plan, clock = run.plan, run.clock
    assert clock.nominal_steps == plan.num_steps == math.ceil(epochs * math.ceil(dataset_size / 8))
    assert all(clock.virtual_step(k) == k for k in range(plan.num_steps + 1))
    assert {clock.scale(k) for k in range(plan.num_steps) if plan.sizes[k] == 8} == {1.0}


def test_virtual_step_counts_samples_when_the_batch_grows():
    plan = build_plan(PhaseSchedule([8, 32], boundaries=[0.5]), dataset_size=256, budget=256)
    clock = SampleClock(plan, resolve_rule("sqrt"), 8, nominal_steps=32, steps_per_epoch=32)
    assert list(plan.sizes) == [8] * 16 + [32] * 4
    # the steps of 32 samples advance the base schedule by 4 steps of 8 each
    assert [clock.virtual_step(k) for k in range(14, 21)] == [14, 15, 16, 20, 24, 28, 32]
    assert [clock.scale(k) for k in (0, 15, 16, 19)] == [1.0, 1.0, 2.0, 2.0]


def test_a_short_epoch_end_step_counts_as_one_step_of_the_base_schedule():
    # 60 samples an epoch at 8 are 8 plain steps, the last of 4; a step of 16 after it advances by 2
    plan = build_plan(PhaseSchedule([8, 16], boundaries=[60], unit="samples"), dataset_size=60, budget=120)
    clock = SampleClock(plan, resolve_rule("none"), 8, nominal_steps=16, steps_per_epoch=8)
    assert list(plan.sizes) == [8] * 7 + [4] + [16] * 3 + [12]
    assert [clock.virtual_step(k) for k in range(6, 13)] == [6, 7, 8, 10, 12, 14, 16]


def test_check_evaluates_the_rule_on_every_phase_before_training():
    plan = build_plan(PhaseSchedule([8, 16], boundaries=[0.5]), dataset_size=64, budget=64)
    clock = SampleClock(plan, lambda b, b0: 1.0 if b == b0 else -1.0, 8, 8)
    with pytest.raises(ValueError, match="effective batch 16"):
        clock.check()
    assert math.isclose(SampleClock(plan, resolve_rule("linear"), 8, 8).scale(10**6), 2.0)
