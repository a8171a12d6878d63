"""NoiseScaleSchedule: the step time model and the goodput rule (exact values), and, through the Trainer on linear
regression, growth where the noise scale rises, none where it stays below the batch, exact accounting after a
change (every sample once, the budget, the LR rule, the loop's length) and an exact resume."""

import json
import math

import pytest
import torch
from helpers import (
    QUIET_CPU_RUN,
    REGRESSION_DIM,
    REGRESSION_NOISE_STD,
    REGRESSION_TARGET,
    REGRESSION_WEIGHT,
    LinearRegression,
    RegressionRows,
    adaptive_of,
    assert_same_parameters,
    logged,
    logged_or_none,
    saved_state,
    step_logs,
)

from adaptive_batch import AdaptiveBatch, NoiseScaleSchedule
from adaptive_batch.core.goodput import StepCosts, StepTimeModel, goodput_gain
from adaptive_batch.core.lr import gain
from adaptive_batch.core.noise import NoiseScale
from adaptive_batch.core.schedule import Progress

# -- the step time model -------------------------------------------------------------------------------------------


def timed(model: StepTimeModel, rows: int, micro_batches: int, seconds: float, times: int = 3) -> None:
    for _ in range(times):
        model.record(rows, micro_batches, seconds)


def test_three_configurations_give_the_per_step_per_micro_batch_and_per_row_parts():
    model = StepTimeModel()
    for rows, n in [(8, 1), (8, 2), (16, 1), (32, 4)]:
        timed(model, rows, n, 0.5 + 0.2 * n + 0.01 * rows)
    assert model.coefficients() == pytest.approx((0.5, 0.2, 0.01), rel=1e-9)
    assert model.predict(64, 1) == pytest.approx(0.5 + 0.2 + 0.64, rel=1e-9)


def test_two_configurations_at_one_size_assume_no_per_step_part():
    """A step of 8 rows in one micro-batch (0.78 s) and in two (0.98 s): a micro-batch's fixed part is 0.2 s, the
    rest, 0.58 s, is taken as per-row (the least a larger batch can gain)."""
    model = StepTimeModel()
    timed(model, 8, 1, 0.78)
    timed(model, 8, 2, 0.98)
    f, a, b = model.coefficients()
    assert (f, a, b * 8) == pytest.approx((0.0, 0.2, 0.58), rel=1e-9)
    assert model.predict(16, 1) == pytest.approx(0.2 + 2 * 0.58, rel=1e-9)


def test_nothing_is_predicted_before_two_configurations_are_timed_enough():
    model = StepTimeModel(min_steps=3)
    timed(model, 8, 1, 1.0, times=5)
    timed(model, 8, 2, 1.5, times=2)
    assert model.predict(16, 1) is None
    model.record(8, 2, 1.5)
    assert model.predict(16, 1) is not None


def test_the_median_discards_a_step_that_also_saved_a_checkpoint():
    model = StepTimeModel()
    for seconds in (1.0, 1.0, 30.0, 1.0):  # one step also wrote a checkpoint
        model.record(8, 1, seconds)
    assert model.medians() == {(8, 1): 1.0}


def test_the_time_model_survives_its_state_dict():
    model = StepTimeModel()
    timed(model, 8, 1, 0.78)
    timed(model, 8, 2, 0.98)
    again = StepTimeModel()
    again.load_state_dict(model.state_dict())
    assert again.predict(16, 1) == model.predict(16, 1)


# -- goodput -------------------------------------------------------------------------------------------------------


def test_goodput_gain_is_speed_times_statistical_efficiency():
    # 32 -> 64 samples with the step time 1.0 -> 1.5 s: 4/3 the speed; at a noise scale of 64:
    # efficiency (64 + 32) / (64 + 64) = 3/4, so the goodput is unchanged
    assert goodput_gain(32, 1.0, 64, 1.5, 64) == pytest.approx(1.0, rel=1e-12)
    assert goodput_gain(32, 1.0, 64, 1.5, math.inf) == pytest.approx(4 / 3, rel=1e-12)


def two_sizes(start_seconds: float, next_seconds: float, rows: int = 32) -> StepTimeModel:
    """A time model with f = 0 that predicts `start_seconds` at `rows` in one micro-batch and `next_seconds` at
    twice the rows in one."""
    # T = a n + b r: a + b rows = start, a + 2 b rows = next
    b = (next_seconds - start_seconds) / rows
    a = start_seconds - b * rows
    model = StepTimeModel()
    timed(model, rows, 1, a + b * rows)
    timed(model, rows, 2, 2 * a + b * rows)
    return model


def test_it_grows_only_where_the_goodput_gain_beats_the_margin():
    schedule = NoiseScaleSchedule(32, max_size=256, margin=0.05, min_samples_between_changes=0)
    times = two_sizes(1.0, 1.5)  # 4/3 the speed at 64
    # noise scale 64: gain 1.0 (see above), stays; 1,000: 4/3 x 1032 / 1064 = 1.293, grows
    assert schedule.propose(32, 3200, 64.0, StepCosts(times)) is None
    size, reason = schedule.propose(32, 3200, 1000.0, StepCosts(times))
    assert size == 64 and reason.startswith("goodput x1.293 at 64")
    # at the threshold: 4/3 (B + 32) / (B + 64) = 1.05 at B = 86.6
    assert schedule.propose(32, 3200, 86.0, StepCosts(times)) is None
    assert schedule.propose(32, 3200, 88.0, StepCosts(times))[0] == 64
    assert schedule.propose(32, 3200, None, StepCosts(times)) is None  # noise not measured yet
    assert schedule.propose(32, 3200, 1000.0, StepCosts(StepTimeModel())) is None  # nothing timed yet


def test_the_runs_efficiency_weighs_each_stretch_by_its_samples():
    schedule = NoiseScaleSchedule(32, max_size=256, min_samples_between_changes=0)
    assert schedule.run_efficiency(1000) == 1.0  # at the start every sample counts fully
    schedule.change(step=31, size=64, samples_seen=1000, reason="test", noise_scale=32.0)
    # 1,000 samples at 32, then 1,000 at 64 decided on a noise scale of 32: (32 + 32) / (32 + 64) = 2/3 each
    assert schedule.run_efficiency(2000) == pytest.approx((1000 + 1000 * 2 / 3) / 2000)
    # the rest of a 4,000-sample budget at 128 on a noise scale of 96: (96 + 32) / (96 + 128) = 4/7 each
    projected = schedule.run_efficiency(2000, then=(128, 96.0), budget=4000)
    assert projected == pytest.approx((1000 + 1000 * 2 / 3 + 2000 * 4 / 7) / 4000)


def test_a_finite_budget_grows_only_while_the_runs_efficiency_stays_above_the_bound():
    times = two_sizes(1.0, 1.5)  # 4/3 the speed at 64: on a noise scale of 1,000 the goodput gains x1.293
    free = NoiseScaleSchedule(32, max_size=256, min_samples_between_changes=0, min_efficiency=None)
    assert free.propose(32, 3200, 1000.0, StepCosts(times), budget=6400)[0] == 64
    # on a noise scale of 200 the goodput gains x1.172 at 64, but the whole budget there counts (200 + 32) /
    # (200 + 64) = 0.879: goodput alone grows, the default bound of 0.9 keeps 32; with no budget it grows
    assert free.propose(32, 0, 200.0, StepCosts(times), budget=6400)[0] == 64
    default = NoiseScaleSchedule(32, max_size=256, min_samples_between_changes=0)
    assert default.propose(32, 0, 200.0, StepCosts(times), budget=6400) is None
    assert default.propose(32, 0, 200.0, StepCosts(times), budget=None)[0] == 64
    # the rest at 64 counts (1000 + 32) / (1000 + 64) = 0.970 each: the run's 0.985, over 0.98 but under 0.99
    loose = NoiseScaleSchedule(32, max_size=256, min_samples_between_changes=0, min_efficiency=0.98)
    size, reason = loose.propose(32, 3200, 1000.0, StepCosts(times), budget=6400)
    assert size == 64 and "the run's efficiency 0.985 with the rest at 64" in reason
    tight = NoiseScaleSchedule(32, max_size=256, min_samples_between_changes=0, min_efficiency=0.99)
    assert tight.propose(32, 3200, 1000.0, StepCosts(times), budget=6400) is None
    # later in the run less is left to lose: the same bound lets it grow
    assert tight.propose(32, 6000, 1000.0, StepCosts(times), budget=6400)[0] == 64
    with pytest.raises(ValueError, match="min_efficiency=1.5 must be in \\(0, 1\\]"):
        NoiseScaleSchedule(32, max_size=256, min_efficiency=1.5)


def test_a_capped_micro_batch_predicts_the_larger_step_in_more_micro_batches():
    schedule = NoiseScaleSchedule(32, max_size=256, min_samples_between_changes=0)
    times = two_sizes(1.0, 1.1)  # a = 0.9 s per micro-batch, b = 0.1 / 32 s per row: launch-bound
    grown = schedule.propose(32, 0, 1e6, StepCosts(times))
    assert grown is not None and "1.1 s at 64" in grown[1]
    # micro-batches of at most 32 rows: 64 rows take two, 0.9 x 2 + 0.2 = 2.0 s: 64 / 2.0 vs 32 / 1.0, no gain
    assert schedule.propose(32, 0, 1e6, StepCosts(times, micro_batch_cap=32)) is None


def test_a_change_waits_until_steps_at_the_current_size_are_timed():
    """Steps of 16 and 32 rows take the same time (launch-bound): extrapolated, 64 rows look free. Just after a
    change to 64, nothing decides until 64's own steps are timed; they show the cost, and it stays."""
    schedule = NoiseScaleSchedule(16, max_size=256, min_samples_between_changes=0)
    times = StepTimeModel()
    timed(times, 16, 1, 1.0)
    timed(times, 32, 1, 1.0)
    assert schedule.propose(16, 0, 100.0, StepCosts(times))[0] == 32
    assert times.predict(128, 1) == pytest.approx(1.0)  # 64 -> 128 looks free from here
    assert schedule.propose(64, 0, 100.0, StepCosts(times)) is None  # 64 not timed yet
    timed(times, 64, 1, 2.0)  # twice the time for twice the rows of 32
    assert times.measured(64, 1) and not times.measured(128, 1)
    assert schedule.propose(64, 0, 100.0, StepCosts(times)) is None


def test_changes_wait_for_the_stated_samples_and_stop_at_the_maximum():
    schedule = NoiseScaleSchedule(32, max_size=100, min_samples_between_changes=640)
    times = two_sizes(1.0, 1.0)
    assert schedule.propose(32, 639, 1e6, StepCosts(times)) is None
    assert schedule.propose(32, 640, 1e6, StepCosts(times))[0] == 64
    schedule.change(20, 64, 640, "test")
    assert schedule.propose(64, 1279, 1e6, StepCosts(times)) is None
    assert schedule.next_size(64, 1) == 100 and schedule.next_size(100, 1) is None
    assert schedule.sizes(world_size=1) == [32, 64, 100]
    assert schedule.sizes(world_size=8) == [32, 64, 96]  # multiples of the world


def test_the_schedule_answers_by_step_from_its_changes_and_keeps_them_in_its_state():
    schedule = NoiseScaleSchedule(16, max_size=64)
    schedule.change(10, 32, 160, "first")
    schedule.change(25, 64, 640, "second")
    assert [schedule(Progress(step, 0, 0.0)) for step in (0, 9, 10, 24, 25, 99)] == [16, 16, 32, 32, 64, 64]
    with pytest.raises(ValueError, match="before the last one"):
        schedule.change(20, 64, 700, "late")
    again = NoiseScaleSchedule(16, max_size=64)
    again.load_state_dict(schedule.state_dict())
    assert again.changes == schedule.changes
    again.reset()
    assert again(Progress(30, 0, 0.0)) == 16


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(start=32, max_size=16), "max_size=16 is below start=32"),
        (dict(start=0, max_size=16), "start=0 is not a positive int: it is the first effective batch"),
        (
            dict(start=8, max_size=0),
            r"max_size=0 is not a positive int: .* NoiseScaleSchedule\(8, max_size=128\)",
        ),
        (dict(start=8, max_size=16, factor=1), "factor=1 must be greater than 1"),
        (dict(start=8, max_size=16, margin=1.5), r"margin=1.5 must be in \[0, 1\)"),
        (dict(start=8, max_size=16, confidence_z=-1), "confidence_z=-1 must be at least 0"),
        (dict(start=8, max_size=16, min_samples_between_changes=-5), "min_samples_between_changes=-5"),
        (dict(start=8, max_size=16, measure_every=1.5), "measure_every=1.5 must be an integer >= 0"),
    ],
)
def test_bad_settings_are_refused_with_the_rule(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NoiseScaleSchedule(**kwargs)


def test_a_schedule_without_its_max_size_gets_one_error_naming_it_and_an_example():
    # NoiseScaleSchedule(0) ended in Python's "missing 1 required positional argument: 'max_size'"
    with pytest.raises(ValueError) as error:
        NoiseScaleSchedule(0)
    assert str(error.value) == (
        "NoiseScaleSchedule start=0 is not a positive int: it is the first effective batch, in samples per optimizer "
        "step (all GPUs), and it needs max_size, the largest it may grow to; e.g. NoiseScaleSchedule(32, "
        "max_size=512): start at 32 samples a step, grow up to 512."
    )
    with pytest.raises(TypeError) as error:
        NoiseScaleSchedule(32)
    assert str(error.value) == (
        "NoiseScaleSchedule(32) needs max_size, the largest effective batch it may grow to (at most the dataset's "
        "size); e.g. NoiseScaleSchedule(32, max_size=512)."
    )
    assert NoiseScaleSchedule(32.0, max_size=64).start == 32  # a whole float is a size, as in any schedule


# -- through the Trainer -------------------------------------------------------------------------------------------


def fixed_step_time(seconds_per_row: float):
    """A stand-in for measured step times, so that decisions do not depend on this machine's speed: 1 s a step
    plus `seconds_per_row` a row (what `StepTimeModel.predict` returns)."""

    def predict(self, rows, micro_batches):
        return 1.0 + seconds_per_row * rows

    return predict


def growing_trainer(
    tmp_path,
    schedule,
    learning_rate: float,
    weight=REGRESSION_WEIGHT,
    rows=6400,
    micro_batch_size=16,
    lr_scaling="sqrt",
    **overrides,
):
    from transformers import Trainer, TrainingArguments

    settings = dict(QUIET_CPU_RUN)
    settings.update(overrides)
    callback = AdaptiveBatch(
        schedule=schedule,
        micro_batch_size=micro_batch_size,
        lr_scaling=lr_scaling,
        noise_time_constant_samples=320,
    )
    return Trainer(
        model=LinearRegression(weight),
        args=TrainingArguments(
            output_dir=str(tmp_path / "growing"),
            per_device_train_batch_size=8,
            num_train_epochs=1,
            learning_rate=learning_rate,
            lr_scheduler_type="constant",
            optim="sgd",
            max_grad_norm=0,
            **settings,
        ),
        train_dataset=RegressionRows(rows, REGRESSION_TARGET, REGRESSION_NOISE_STD),
        callbacks=[callback],
    )


class RowsSeen:
    """Every row of x the model is given, as bytes."""

    def __init__(self, model):
        self.rows: list[bytes] = []
        model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        self.rows.extend(row.numpy().tobytes() for row in kwargs["x"])


def test_the_batch_grows_as_the_noise_scale_rises_and_the_accounting_stays_exact(tmp_path, monkeypatch):
    """SGD on linear regression: |G|^2 = |w - w*|^2 shrinks while tr(Sigma) tends to d s^2, so the noise scale
    (9 |r|^2 + 8) / |r|^2 rises from 17. With 1 s a step plus 0.02 s a row, doubling 32 pays once the noise
    scale's lower bound passes 55."""
    monkeypatch.setattr(StepTimeModel, "predict", fixed_step_time(0.02))
    schedule = NoiseScaleSchedule(
        32, max_size=256, min_samples_between_changes=640, min_efficiency=None
    )  # goodput alone
    trainer = growing_trainer(tmp_path, schedule, learning_rate=0.05)
    seen = RowsSeen(trainer.model)
    trainer.train()
    plan = adaptive_of(trainer).plan
    assert [c.size for c in schedule.changes][:2] == [64, 128]
    sizes = logged(trainer, "adaptive_batch/effective_batch_size")
    assert sizes == list(plan.sizes) and sizes[0] == 32
    assert sorted(plan.scheduled) == list(
        plan.scheduled
    )  # it only grows (the epoch's last step holds its rest)
    for (
        change
    ) in schedule.changes:  # each from the step the data loader had not drawn, after 640 samples or more
        assert plan.scheduled[change.step - 1] < change.size == plan.scheduled[change.step]
    assert all(b.samples_seen - a.samples_seen >= 640 for a, b in zip(schedule.changes, schedule.changes[1:]))
    # every sample exactly once, the budget in samples unchanged, the loop ended with the plan
    dataset = trainer.train_dataset
    assert sorted(seen.rows) == sorted(row.numpy().tobytes() for row in dataset.x)
    assert logged(trainer, "adaptive_batch/samples_seen")[-1] == len(dataset) == plan.num_samples
    assert trainer.state.global_step == trainer.state.max_steps == plan.num_steps < len(dataset) // 32
    # the LR rule follows the batch: sqrt(B / 32)
    assert logged(trainer, "adaptive_batch/lr_scale") == [math.sqrt(size / 32) for size in sizes]
    assert logged(trainer, "learning_rate") == pytest.approx([0.05 * math.sqrt(size / 32) for size in sizes])
    # the micro-batch size (fixed at 16) is kept: a step of B rows runs B / 16 micro-batches
    assert logged(trainer, "adaptive_batch/accumulation_steps") == [size // 16 for size in sizes]
    # the modelled efficiency of the run so far: 1 at the start, falling once the batch grew, as the schedule says
    efficiency = logged(trainer, "adaptive_batch/statistical_efficiency")
    seen_so_far = logged(trainer, "adaptive_batch/samples_seen")
    assert efficiency == [schedule.run_efficiency(samples) for samples in seen_so_far]
    assert efficiency[0] == 1.0 and efficiency[-1] < 1.0


@pytest.mark.parametrize("rule, power", [("gain", 1.0), ("sqrt_gain", 0.5)])
def test_a_gain_rule_scales_the_lr_by_adascale_s_gain_at_each_change(tmp_path, monkeypatch, rule, power):
    """lr_scaling='gain': each size's LR multiplier is r = (B / 32)(B_noise + 32) / (B_noise + B), B_noise the
    noise scale measured when the change was decided; 'sqrt_gain': sqrt(r)."""
    monkeypatch.setattr(StepTimeModel, "predict", fixed_step_time(0.02))
    schedule = NoiseScaleSchedule(
        32, max_size=256, min_samples_between_changes=640, min_efficiency=None
    )  # goodput alone
    trainer = growing_trainer(tmp_path, schedule, learning_rate=0.05, lr_scaling=rule)
    trainer.train()
    assert len(schedule.changes) >= 2
    sizes = logged(trainer, "adaptive_batch/effective_batch_size")
    noise_scales = [schedule.noise_scale_at(step) for step in range(len(sizes))]
    # (near the optimum |G|^2 is not told apart from the noise: an infinite noise scale, the linear rule)
    expected = [
        (size / 32 if math.isinf(b) else (size / 32) * (b + 32) / (b + size)) ** power if size > 32 else 1.0
        for size, b in zip(sizes, noise_scales)
    ]
    assert logged(trainer, "adaptive_batch/lr_scale") == pytest.approx(expected, rel=1e-12)
    assert logged(trainer, "learning_rate") == pytest.approx([0.05 * x for x in expected], rel=1e-9)
    first = schedule.changes[0]  # measured, finite: a gain strictly between the two bounds
    assert 0 < first.noise_scale < math.inf and 1 < gain(first.size, 32, first.noise_scale) < first.size / 32


def test_a_gain_rule_needs_a_noise_scale_schedule():
    with pytest.raises(
        ValueError, match=r"lr_scaling='gain' takes AdaScale's gain .* the schedule is 64 \(constant\)"
    ):
        AdaptiveBatch(schedule=64, lr_scaling="gain")
    with pytest.raises(ValueError, match="lr_scaling='sqrt_gain'"):
        AdaptiveBatch(lr_scaling="sqrt_gain")


def test_adascale_gain_between_one_and_the_batch_ratio():
    assert gain(64, 16, 48.0) == pytest.approx(4 * 64 / 112)
    assert gain(64, 16, math.inf) == 4.0  # noise dominates: the linear rule
    assert gain(64, 16, 0.0) == 1.0  # no noise: a larger batch buys no larger step
    assert gain(8, 16, 48.0) == 0.5  # below the start: the linear rule
    schedule = NoiseScaleSchedule(16, max_size=64)
    schedule.change(10, 32, 160, "first", 40.0)
    schedule.change(20, 64, 480, "second")  # not measured: inf
    assert [schedule.noise_scale_at(s) for s in (0, 10, 19, 20)] == [math.inf, 40.0, 40.0, math.inf]
    again = NoiseScaleSchedule(16, max_size=64)
    again.load_state_dict(json.loads(json.dumps(schedule.state_dict())))
    assert again.changes == schedule.changes
    again.load_state_dict({"changes": [[10, 32, 160, "a checkpoint of four fields"]]})
    assert again.noise_scale_at(10) == math.inf


def test_without_a_wait_between_changes_each_grows_from_the_last_one(tmp_path, monkeypatch):
    """With min_samples_between_changes=0 a decision can come while the last change still waits in steps the data
    loader has not drawn: it grows from that change's size, never to the same size twice."""
    monkeypatch.setattr(StepTimeModel, "predict", fixed_step_time(0.0))  # a step costs the same at any size
    schedule = NoiseScaleSchedule(
        16, max_size=256, min_samples_between_changes=0, min_efficiency=None
    )  # goodput alone
    # a worker that draws two steps ahead (prefetch_factor 2)
    trainer = growing_trainer(tmp_path, schedule, learning_rate=0.05, rows=3200, dataloader_num_workers=1)
    trainer.train()
    changes = schedule.changes
    assert [c.size for c in changes] == [32, 64, 128, 256]
    assert all(a.step < b.step for a, b in zip(changes, changes[1:]))
    plan = adaptive_of(trainer).plan
    for change in changes:
        assert plan.scheduled[change.step] == change.size


def test_the_batch_stays_where_the_noise_scale_is_below_it(tmp_path, monkeypatch):
    """Learning rate 0 far from the optimum: |r|^2 = 100, noise scale (9 x 100 + 8) / 100 = 9.1 samples, below the
    batch of 32: doubling would cost more in efficiency ((9.1 + 32) / (9.1 + 64) = 0.56) than it gains in speed
    (2 x 1.64 / 2.28 = 1.44)."""
    monkeypatch.setattr(StepTimeModel, "predict", fixed_step_time(0.02))
    schedule = NoiseScaleSchedule(32, max_size=256, min_samples_between_changes=320)
    far = torch.full((REGRESSION_DIM,), 10 * REGRESSION_DIM**-0.5, dtype=torch.float64)
    trainer = growing_trainer(tmp_path, schedule, learning_rate=0.0, weight=far, rows=3200)
    trainer.train()
    assert schedule.changes == []
    assert set(logged(trainer, "adaptive_batch/effective_batch_size")) == {32}
    assert logged(trainer, "adaptive_batch/noise_scale")[-1] == pytest.approx(9.08, rel=0.25)


@pytest.mark.parametrize("rule", ["sqrt", "gain"])
def test_a_resumed_run_continues_with_the_changes_made_before_its_checkpoint(tmp_path, monkeypatch, rule):
    monkeypatch.setattr(StepTimeModel, "predict", fixed_step_time(0.02))

    def run(output, resume=None):
        schedule = NoiseScaleSchedule(
            32, max_size=256, min_samples_between_changes=640, min_efficiency=None
        )  # goodput alone
        trainer = growing_trainer(
            tmp_path / output,
            schedule,
            learning_rate=0.05,
            lr_scaling=rule,
            save_strategy="steps",
            save_steps=60,
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer, schedule

    whole, whole_schedule = run("whole")
    assert whole_schedule.changes and whole_schedule.changes[0].step < 60  # the checkpoint holds a change
    checkpoint = str(tmp_path / "whole" / "growing" / "checkpoint-60")
    resumed, resumed_schedule = run("resumed", resume=checkpoint)
    assert resumed_schedule.changes == whole_schedule.changes
    assert list(adaptive_of(resumed).plan.sizes) == list(adaptive_of(whole).plan.sizes)
    # (the resumed run's log history holds the checkpoint's 60 steps, then its own)
    for key in ("adaptive_batch/effective_batch_size", "adaptive_batch/noise_scale", "learning_rate", "loss"):
        assert logged_or_none(resumed, key) == logged_or_none(whole, key)
    assert_same_parameters(resumed.model, whole.model)

    # the schedule is compared by its settings (its changes are the checkpoint's): other settings are refused
    smaller = NoiseScaleSchedule(32, max_size=128, min_samples_between_changes=640)
    other = growing_trainer(tmp_path / "other", smaller, learning_rate=0.05, lr_scaling=rule)
    with pytest.raises(ValueError, match="another step plan") as error:
        other.train(resume_from_checkpoint=checkpoint)
    stored, now = whole_schedule.describe(), smaller.describe()
    assert stored.startswith("32 growing by goodput up to 256 (x2, ")
    assert f"Changed: schedule: {stored!r} in the checkpoint, {now!r} now." in str(error.value)


def test_measuring_on_one_process_cuts_every_fourth_step_in_two(tmp_path, monkeypatch):
    """A step of one micro-batch measures nothing on one process: with the micro-batch as large as the step, every
    fourth step is cut in two, and the noise scale is measured on those."""
    monkeypatch.setattr(StepTimeModel, "predict", fixed_step_time(0.02))
    schedule = NoiseScaleSchedule(
        16, max_size=32
    )  # (no change within 12 steps: 20 steps of 16 between changes)
    trainer = growing_trainer(tmp_path, schedule, learning_rate=0.0, rows=16 * 12)
    trainer.train()
    assert logged(trainer, "adaptive_batch/accumulation_steps") == [1, 1, 1, 2] * 3
    # only the logs of the steps cut in two carry the noise scale's averages
    measured = ["adaptive_batch/grad_norm_sq" in log for log in step_logs(trainer)]
    assert measured == [False, False, False, True] * 3
    noise = NoiseScale(320)  # the run's averages, as its checkpoint holds them
    noise.load_state_dict(saved_state(trainer)["noise"])
    assert (
        noise.steps == 3 and noise.samples_seen == 16 * 12
    )  # forgetting by the 64 samples between measurements
    # weights (1 - r_1) r r, (1 - r) r, 1 - r: the first step forgets by its own 16 samples, the others by 64
    r_1, r = math.exp(-16 / 320), math.exp(-64 / 320)
    weights = [(1 - r_1) * r * r, (1 - r) * r, 1 - r]
    assert noise.effective_steps == pytest.approx(sum(weights) ** 2 / sum(w * w for w in weights), rel=1e-12)


class LaunchBound:
    """Step times where a micro-batch's fixed cost is most of a step: 0.7 s a micro-batch plus 0.3 s per 16 rows
    (a step of 16 rows: 1 s in one micro-batch; 32 rows: 1.3 s, x1.54 the samples per second)."""

    def predict(self, rows, micro_batches):
        return 0.7 * micro_batches + 0.3 * rows / 16


def test_steps_are_cut_in_two_while_a_change_could_pay():
    schedule = NoiseScaleSchedule(16, max_size=32)
    assert schedule.cut_every(16, StepCosts(LaunchBound())) == 4
    assert schedule.cut_every(16, StepCosts(StepTimeModel())) == 4  # nothing timed yet
    assert schedule.cut_every(32, StepCosts(LaunchBound())) == 0  # at max_size
    # a micro-batch of 16 at most: a step of 32 is two, 2 s for x2 the samples of 1 s, not faster per sample
    assert schedule.cut_every(16, StepCosts(LaunchBound(), micro_batch_cap=16)) == 0
    assert NoiseScaleSchedule(16, 32, measure_every=0).cut_every(16, StepCosts(LaunchBound())) == 0


@pytest.mark.parametrize(
    "max_size, seconds_per_row",
    [
        (16, 0.02),  # at max_size: nothing left to decide
        (
            32,
            1.0,
        ),  # 1 + 32 s against 1 + 16 s: x2 the samples for x1.94 the time, never more than the 5% margin
    ],
)
def test_no_step_is_cut_in_two_where_no_noise_scale_could_make_a_change_pay(
    tmp_path, monkeypatch, max_size, seconds_per_row
):
    monkeypatch.setattr(StepTimeModel, "predict", fixed_step_time(seconds_per_row))
    schedule = NoiseScaleSchedule(16, max_size=max_size)
    assert schedule.cut_every(16, StepCosts(StepTimeModel())) == 0
    trainer = growing_trainer(tmp_path, schedule, learning_rate=0.0, rows=16 * 12)
    trainer.train()
    assert logged(trainer, "adaptive_batch/accumulation_steps") == [1] * 12
    assert adaptive_of(trainer).current()["noise_steps"] == 0


def test_a_noise_scale_schedule_needs_the_measurement_and_a_dataset_large_enough(tmp_path):
    from transformers import Trainer, TrainingArguments

    def make(callback, rows=64):
        return Trainer(
            model=LinearRegression(REGRESSION_WEIGHT),
            args=TrainingArguments(output_dir=str(tmp_path / "x"), **QUIET_CPU_RUN),
            train_dataset=RegressionRows(rows, REGRESSION_TARGET, REGRESSION_NOISE_STD),
            callbacks=[callback],
        )

    with pytest.raises(ValueError, match="measure_noise=False turns its measurement off"):
        make(AdaptiveBatch(schedule=NoiseScaleSchedule(8, max_size=32), measure_noise=False))
    with pytest.raises(ValueError, match="may grow the effective batch to 128, more than the dataset's 64"):
        make(AdaptiveBatch(schedule=NoiseScaleSchedule(8, max_size=128)))
