"""The gradient noise scale: the estimator's arithmetic (exact values), its reading of each micro-batch's gradient
(gradient checkpointing, Adam's preconditioner, retries, loss scaling), and the logged value against the closed
form of linear regression with Gaussian inputs."""

import copy
import json
import math
import re

import pytest
import torch
from helpers import (
    QUIET_CPU_RUN,
    REGRESSION_NOISE_STD,
    REGRESSION_TARGET,
    REGRESSION_WEIGHT,
    GradientCapture,
    LinearRegression,
    RegressionRows,
    assert_same_parameters,
    logged,
    logged_or_none,
    regression_truth,
    step_logs,
)

from adaptive_batch import AdaptiveBatch, PhaseSchedule
from adaptive_batch.core.config import AdaptiveBatchConfig
from adaptive_batch.core.noise import MicroBatchSums, NoiseScale, StepEstimate
from adaptive_batch.runtime.noise_hooks import GradientNoiseMeter
from adaptive_batch.testing import FakeOutOfMemory

NOISE_KEYS = ("adaptive_batch/noise_scale", "adaptive_batch/grad_norm_sq", "adaptive_batch/grad_variance")


def step_estimate(micro_batches, step_norm_sq: float, total_units: float) -> StepEstimate | None:
    """One step's estimates (per unit) from its micro-batches `(n_j, |d_j|^2)`, the loss averaged over `total_units`."""
    sums = MicroBatchSums()
    for units, norm_sq in micro_batches:
        sums.add(units, units / total_units, norm_sq)
    return sums.estimate(step_norm_sq)


# -- the estimator -------------------------------------------------------------------------------------------------


def test_step_estimate_is_the_formula_of_the_issue():
    # d_1 = (1, 0), d_2 = (0, 1) of 2 units each (N = 4): S_small = 2 x 1 + 2 x 1 = 4, S_big = |(1, 1)|^2 = 2
    assert step_estimate([(2, 1.0), (2, 1.0)], 2.0, 4) == StepEstimate(grad_norm_sq=0.0, grad_variance=8.0)
    # unequal: n = 1 and 3 of N = 4: S_small = 4 x 0.25 + 4/3 x 0.75 = 2; |G|^2 = (2 x 0.5 - 2) / 1 = -1 (an
    # unbiased estimate may be negative), tr(Sigma) = 4 x (2 - 0.5) / 1 = 6
    assert step_estimate([(1, 0.25), (3, 0.75)], 0.5, 4) == StepEstimate(-1.0, 6.0)
    # three micro-batches: S_small = 3 x (1 + 2 + 3) = 18, S_big = 4: |G|^2 = (12 - 18) / 2, tr = 6 x 14 / 2 (shares
    # of 1/3 round)
    three = step_estimate([(2, 1.0), (2, 2.0), (2, 3.0)], 4.0, 6)
    assert (three.grad_norm_sq, three.grad_variance) == pytest.approx((-3.0, 42.0), rel=1e-14)
    assert step_estimate([(4, 1.0)], 1.0, 4) is None  # one micro-batch: nothing to compare


@pytest.mark.parametrize(
    "units, shares",
    [
        ([8, 8, 8, 8], [0.25, 0.25, 0.25, 0.25]),  # equal
        ([8, 8, 7, 7], [8 / 30, 8 / 30, 7 / 30, 7 / 30]),  # unequal, shares n_j / N
        # two ranks of 16 and 15 units, each loss a mean over its own: a_j = n_j / (2 T_r), not n_j / N
        ([8, 8, 8, 7], [8 / 32, 8 / 32, 8 / 30, 7 / 30]),
    ],
)
def test_the_estimates_are_unbiased_for_any_micro_batch_sizes_and_shares(units, shares):
    """With E|d_j|^2 = a_j^2 (|G|^2 + tr(Sigma) / n_j) and E|G_step|^2 = |G|^2 + tr(Sigma) sum a_j^2 / n_j, the
    expected sums give back |G|^2 and tr(Sigma)."""
    grad_norm_sq, variance = 2.5, 40.0
    sums = MicroBatchSums()
    for n, a in zip(units, shares):
        sums.add(n, a, a * a * (grad_norm_sq + variance / n))
    step_norm_sq = grad_norm_sq + variance * sum(a * a / n for n, a in zip(units, shares))
    estimate = sums.estimate(step_norm_sq)
    assert sums.complete and sums.count == len(units) and sums.units == sum(units)
    assert estimate.grad_norm_sq == pytest.approx(grad_norm_sq, rel=1e-12)
    assert estimate.grad_variance == pytest.approx(variance, rel=1e-12)
    # per sample: a unit counts as samples / units of a sample (31 units over 62 samples: 2 samples a unit)
    assert sums.estimate(step_norm_sq, samples=2 * sum(units)).grad_variance == pytest.approx(2 * variance)


def test_the_ranks_sums_add_up_to_those_of_one_process():
    one = MicroBatchSums()
    ranks = [MicroBatchSums(), MicroBatchSums()]
    for j, (n, a, norm_sq) in enumerate([(3, 0.3, 0.5), (4, 0.4, 0.25), (3, 0.3, 2.0)]):
        one.add(n, a, norm_sq)
        ranks[j % 2].add(n, a, norm_sq)
    together = [a + b for a, b in zip(ranks[0].to_list(), ranks[1].to_list())]
    assert MicroBatchSums.from_list(together).to_list() == pytest.approx(one.to_list(), rel=1e-15)
    # S_small, A = 0.1 + 0.1 + 0.1, B = 0.03 + 0.04 + 0.03, shares, units, count
    expected = [0.5 / 0.3 + 0.25 / 0.4 + 2.0 / 0.3, 0.3, 0.1, 1.0, 10.0, 3.0]
    assert one.to_list() == pytest.approx(expected, rel=1e-15)


def test_the_averages_are_bias_corrected_and_weighted_by_samples():
    noise = NoiseScale(time_constant_samples=20)
    assert noise.value is None and noise.lower_bound() is None
    assert noise.update(StepEstimate(2.0, 40.0), samples=10)
    assert (noise.grad_norm_sq, noise.grad_variance, noise.value) == (
        2.0,
        40.0,
        20.0,
    )  # the first step, whole
    assert noise.lower_bound() == 0.0  # one step: no spread to judge by
    noise.update(StepEstimate(4.0, 20.0), samples=30)
    # weights (1 - e^-0.5) e^-1.5 and (1 - e^-1.5), over their sum
    first, second = (1 - math.exp(-0.5)) * math.exp(-1.5), 1 - math.exp(-1.5)
    expected_norm_sq = (first * 2.0 + second * 4.0) / (first + second)
    expected_variance = (first * 40.0 + second * 20.0) / (first + second)
    assert noise.grad_norm_sq == pytest.approx(expected_norm_sq, rel=1e-14)
    assert noise.grad_variance == pytest.approx(expected_variance, rel=1e-14)
    assert noise.value == pytest.approx(expected_variance / expected_norm_sq, rel=1e-14)
    assert noise.effective_steps == pytest.approx((first + second) ** 2 / (first**2 + second**2), rel=1e-14)


def test_given_the_samples_seen_the_averages_forget_by_the_samples_since_the_last_step_averaged():
    """One process measures every fourth step: the steps between count towards the forgetting, so that the time
    constant spans the same samples of training however often the noise is measured."""
    sparse, dense = NoiseScale(time_constant_samples=20), NoiseScale(time_constant_samples=20)
    sparse.update(StepEstimate(2.0, 40.0), samples=10, samples_seen=10)
    sparse.update(StepEstimate(4.0, 20.0), samples=10, samples_seen=40)  # two steps of 10 measured nothing
    dense.update(StepEstimate(2.0, 40.0), samples=10)
    dense.update(StepEstimate(4.0, 20.0), samples=30)  # the same weights: 30 samples since the first
    assert sparse.state_dict()["moments"] == dense.state_dict()["moments"]
    assert sparse.samples_seen == 40
    # without the samples seen, only the step's own samples forget
    alone = NoiseScale(time_constant_samples=20)
    alone.update(StepEstimate(2.0, 40.0), samples=10)
    alone.update(StepEstimate(4.0, 20.0), samples=10)
    assert alone.grad_norm_sq < sparse.grad_norm_sq  # the second step weighs less
    # the mark survives a checkpoint
    restored = NoiseScale(time_constant_samples=20)
    restored.load_state_dict(json.loads(json.dumps(sparse.state_dict())))
    assert restored.samples_seen == 40


def test_the_noise_scale_is_a_ratio_of_averages_not_an_average_of_ratios():
    noise = NoiseScale(time_constant_samples=1e15)  # equal weights
    noise.update(StepEstimate(1.0, 10.0), samples=8)
    noise.update(StepEstimate(3.0, 10.0), samples=8)
    assert noise.value == pytest.approx(10.0 / 2.0, rel=1e-12)  # not (10 + 10/3) / 2


def test_the_lower_bound_takes_each_average_z_standard_errors_the_cautious_way():
    noise = NoiseScale(time_constant_samples=1e15)  # equal weights: n_eff = 3
    for norm_sq, variance in [(1.0, 10.0), (2.0, 20.0), (3.0, 30.0)]:
        noise.update(StepEstimate(norm_sq, variance), samples=8)
    assert noise.effective_steps == pytest.approx(3.0, rel=1e-12)
    # spreads 2/3 and 200/3 around 2 and 20; se^2 = spread / (n_eff - 1)
    se_variance, se_norm_sq = noise.standard_errors()
    assert se_variance == pytest.approx(math.sqrt(100 / 3), rel=1e-9)
    assert se_norm_sq == pytest.approx(math.sqrt(1 / 3), rel=1e-9)
    assert noise.lower_bound(z=1.0) == pytest.approx(
        (20 - math.sqrt(100 / 3)) / (2 + math.sqrt(1 / 3)), rel=1e-9
    )
    assert noise.lower_bound(z=0.0) == pytest.approx(noise.value, rel=1e-12)
    assert noise.lower_bound(z=4.0) == 0.0  # 20 - 4 x 5.77 < 0: clamped


def test_a_true_gradient_not_yet_told_apart_from_noise_gives_an_infinite_noise_scale():
    noise = NoiseScale(time_constant_samples=100)
    noise.update(StepEstimate(-0.5, 10.0), samples=8)
    assert noise.value == math.inf


def test_non_finite_steps_are_skipped_and_the_state_round_trips_through_json_exactly():
    noise = NoiseScale(time_constant_samples=300)
    for k in range(5):
        noise.update(StepEstimate(1.0 + 0.1 * k, 10.0 - k), samples=8 + k)
    before = noise.state_dict()
    assert not noise.update(StepEstimate(math.nan, 1.0), samples=8)
    assert not noise.update(StepEstimate(1.0, math.inf), samples=8)
    assert noise.state_dict() == {**before, "skipped": 2}
    restored = NoiseScale(time_constant_samples=300)
    restored.load_state_dict(json.loads(json.dumps(noise.state_dict())))
    for scale in (noise, restored):
        scale.update(StepEstimate(0.7, 3.0), samples=16)
    assert (restored.value, restored.lower_bound()) == (noise.value, noise.lower_bound())  # bit for bit


@pytest.mark.parametrize(
    "setting, message",
    [
        (
            dict(noise_time_constant_samples=0),
            "noise_time_constant_samples=0 must be a positive, finite number",
        ),
        (dict(noise_time_constant_samples=math.inf), "noise_time_constant_samples=inf must be a positive"),
        (dict(noise_time_constant_samples="4096"), "noise_time_constant_samples='4096' must be a positive"),
        (
            dict(noise_preconditioner="sgd"),
            "noise_preconditioner='sgd' must be one of 'none' (raw gradients) or 'adam'",
        ),
        (dict(measure_noise="yes"), "measure_noise='yes' must be True or False."),
    ],
)
def test_noise_settings_are_checked_when_constructed(setting, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        AdaptiveBatchConfig(**setting)
    with pytest.raises(ValueError, match=re.escape(message)):
        AdaptiveBatch(**setting)


# -- reading each micro-batch's gradient ---------------------------------------------------------------------------


def micro_batch_inputs(tokenizer, rows, count: int, size: int = 2):
    from transformers import DataCollatorForLanguageModeling

    collate = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    return [collate(rows[k * size : (k + 1) * size]) for k in range(count)]


@pytest.mark.parametrize("reentrant", [True, False])
def test_each_micro_batch_is_read_alone_under_gradient_checkpointing(tokenizer, rows, reentrant):
    from adaptive_batch.testing import tiny_llama

    model = tiny_llama(tokenizer)
    # a copy without checkpointing: the gradient of each micro-batch alone, by autograd.grad
    reference = copy.deepcopy(model)
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.24
    if enable is not None:
        enable({"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    params = [p for p in reference.parameters() if p.requires_grad]
    meter = GradientNoiseMeter()
    meter.begin_step(model)
    meter.begin_attempt()
    expected = []
    for inputs in micro_batch_inputs(tokenizer, rows, 3):
        meter.begin_micro_batch(units=1.0, share=1 / 3)
        model(**inputs).loss.backward()
        meter.end_micro_batch()
        grads = torch.autograd.grad(reference(**inputs).loss, params)
        expected.append(sum(float(g.double().pow(2).sum()) for g in grads))
    sums = meter.step_sums(world_size=1, every_rank=False)
    measured = [float(norm_sq) for _, _, norm_sq in meter.micro_batches]
    assert measured == pytest.approx(expected, rel=1e-5)  # float32 sums in another order
    assert sums.small == pytest.approx(3 * sum(expected), rel=1e-5) and sums.count == 3
    step = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters())
    assert meter.step_norm_sq() == pytest.approx(step, rel=1e-5)
    meter.remove()
    assert all(not p._backward_hooks for p in model.parameters())


def test_a_gradient_delivered_in_parts_is_detected_and_the_step_left_out():
    layer = torch.nn.Linear(4, 4)

    def shared_twice(x):  # one weight in two reentrant-checkpointed segments: two hook calls in one backward
        for _ in range(2):
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=True)
        return x.sum()

    meter = GradientNoiseMeter()
    meter.begin_step(layer)
    meter.begin_attempt()
    for _ in range(2):
        meter.begin_micro_batch(units=1.0, share=0.5)
        shared_twice(torch.randn(3, 4, requires_grad=True)).backward()
        meter.end_micro_batch()
    with pytest.warns(UserWarning, match="received its gradient in several parts"):
        sums = meter.step_sums(world_size=1, every_rank=False)
    assert math.isnan(sums.shares) and not sums.complete


def test_the_adam_preconditioner_divides_by_the_optimizers_denominator():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, betas=(0.9, 0.99), eps=1e-3)
    inputs = [torch.randn(4, 3) for _ in range(3)]
    meter = GradientNoiseMeter(preconditioner="adam")

    def run_step():
        meter.begin_step(model, optimizer)
        meter.begin_attempt()
        for x in inputs:
            meter.begin_micro_batch(units=4.0, share=1 / 3)
            (model(x).pow(2).sum() / 3).backward()
            meter.end_micro_batch()
        return meter.step_sums(world_size=1, every_rank=False)

    assert math.isnan(run_step().shares)  # no second moments before the first optimizer step: left out
    for _ in range(3):  # three optimizer steps, each on the last step's gradient
        optimizer.step()
        optimizer.zero_grad()
        sums = run_step()
    assert optimizer.state[model.weight]["step"] == 3
    expected = []  # by hand: g / (sqrt(v / (1 - 0.99^t)) + 1e-3), t = 3 optimizer steps
    for x in inputs:
        grads = torch.autograd.grad(model(x).pow(2).sum() / 3, list(model.parameters()))
        total = 0.0
        for p, g in zip(model.parameters(), grads):
            v = optimizer.state[p]["exp_avg_sq"]
            total += float((g / ((v / (1 - 0.99**3)).sqrt() + 1e-3)).pow(2).sum())
        expected.append(total)
    assert [float(norm_sq) for _, _, norm_sq in meter.micro_batches] == pytest.approx(expected, rel=1e-6)
    assert sums.small == pytest.approx(3 * sum(expected), rel=1e-6)


def test_the_adam_preconditioner_warns_once_where_the_optimizer_has_other_state():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    meter = GradientNoiseMeter(preconditioner="adam")
    with pytest.warns(UserWarning, match="reads the optimizer's 'exp_avg_sq'.*which SGD does not hold"):
        meter.begin_step(model, optimizer)
    assert meter.denominators is None


# -- through the Trainer -------------------------------------------------------------------------------------------


def regression_trainer(
    tmp_path, steps: int, effective: int, callback, seed: int = 0, weight=REGRESSION_WEIGHT, **overrides
):
    """A Trainer of `LinearRegression` at `weight` (learning rate 0) on `steps` steps of fresh rows (one epoch)."""
    from transformers import Trainer, TrainingArguments

    settings = dict(QUIET_CPU_RUN, logging_steps=steps)
    settings.update(overrides)
    model = LinearRegression(weight)
    return Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=str(tmp_path / "regression"),
            per_device_train_batch_size=effective,
            num_train_epochs=1,
            learning_rate=0.0,
            max_grad_norm=0,
            **settings,
        ),
        train_dataset=RegressionRows(steps * effective, REGRESSION_TARGET, REGRESSION_NOISE_STD, seed=seed),
        callbacks=[callback],
    )


@pytest.mark.parametrize("micro_batch_size", [8, 7])  # 64 rows: 8 x 8, or 7, 7, 7, 7, 6, 6, 6, 6, 6, 6
def test_the_logged_noise_scale_of_linear_regression_is_within_10_percent_of_the_truth(
    tmp_path, micro_batch_size
):
    # a time constant far beyond the run's 19,200 samples: every step counts about equally
    callback = AdaptiveBatch(micro_batch_size=micro_batch_size, noise_time_constant_samples=1e9)
    trainer = regression_trainer(tmp_path, steps=300, effective=64, callback=callback)
    trainer.train()
    assert logged(trainer, "adaptive_batch/accumulation_steps") == [
        64 // micro_batch_size + (micro_batch_size == 7)
    ]
    norm_sq, variance, noise_scale = regression_truth()  # 1, 17, 17
    (log,) = step_logs(trainer)
    assert log["adaptive_batch/noise_scale"] == pytest.approx(noise_scale, rel=0.10)
    assert log["adaptive_batch/grad_norm_sq"] == pytest.approx(norm_sq, rel=0.10)
    assert log["adaptive_batch/grad_variance"] == pytest.approx(variance, rel=0.10)
    noise = callback.session.noise
    assert 0 < noise.lower_bound() < noise.value and noise.steps == 300


def test_the_logged_estimates_are_those_of_the_micro_batches_gradients(tmp_path):
    """An outside reading of every micro-batch's gradient (the test's own hook): they add up to the step's gradient
    exactly, and the logged values at each step are the estimator's on them."""
    callback = AdaptiveBatch(micro_batch_size=5, noise_time_constant_samples=100)
    trainer = regression_trainer(tmp_path, steps=6, effective=22, callback=callback, logging_steps=1)
    capture = GradientCapture(trainer.model).add_to(trainer)
    trainer.train()
    expected = NoiseScale(100)
    for parts, gradient, log in zip(capture.parts, capture.step_gradients, step_logs(trainer), strict=True):
        assert [rows for rows, _ in parts] == [5, 5, 4, 4, 4]
        assert torch.allclose(sum(d for _, d in parts), gradient, rtol=1e-14, atol=0)
        estimate = step_estimate([(n, float(d @ d)) for n, d in parts], float(gradient @ gradient), 22)
        expected.update(estimate, samples=22)
        assert log["adaptive_batch/grad_norm_sq"] == pytest.approx(expected.grad_norm_sq, rel=1e-10)
        assert log["adaptive_batch/grad_variance"] == pytest.approx(expected.grad_variance, rel=1e-10)


def test_the_noise_scale_does_not_depend_on_loss_scaling(tmp_path):
    """accelerate makes no GradScaler on the CPU (fp16 needs a GPU there), so the Trainer's accelerator is given
    torch's own CPU GradScaler: the Accelerator then scales the loss in `backward`, the optimizer unscales and steps
    through it, as under fp16 on a GPU. Its scale doubles every step; the values logged are those of the run without,
    bit for bit (powers of two scale floats exactly)."""
    runs = {}
    for scaled in (False, True):
        callback = AdaptiveBatch(micro_batch_size=8, noise_time_constant_samples=500)
        trainer = regression_trainer(
            tmp_path / str(scaled), steps=12, effective=32, callback=callback, logging_steps=1
        )
        if scaled:
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
            trainer.accelerator.scaler = scaler
        trainer.train()
        runs[scaled] = [{key: log[key] for key in NOISE_KEYS} for log in step_logs(trainer)]
    assert scaler.get_scale() == 2.0**22  # it was used: 12 steps, doubled after each
    assert runs[True] == runs[False]


def test_measurement_changes_no_training_result_and_its_hooks_leave_with_training(make_trainer):
    runs = {}
    for measure in (True, False):
        trainer = make_trainer([AdaptiveBatch(micro_batch_size=2, measure_noise=measure)], num_rows=24)
        trainer.train()
        runs[measure] = trainer
        assert all(not p._backward_hooks for p in trainer.model.parameters())
    assert_same_parameters(runs[True].model, runs[False].model)
    assert logged(runs[True], "loss") == logged(runs[False], "loss")
    assert all(key in log for log in step_logs(runs[True]) for key in NOISE_KEYS)
    assert not any(key in log for log in step_logs(runs[False]) for key in NOISE_KEYS)


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_in_the_trainer_measures_the_same(make_trainer, reentrant):
    from transformers import TrainingArguments

    # named activation_checkpointing since transformers 5.24
    fields = TrainingArguments.__dataclass_fields__
    name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    runs = []
    for settings in ({}, {name: True, f"{name}_kwargs": {"use_reentrant": reentrant}}):
        trainer = make_trainer([AdaptiveBatch(micro_batch_size=2)], num_rows=16, **settings)
        layer = trainer.model.model.layers[0].input_layernorm
        counted = []
        layer.register_forward_hook(lambda *args, counted=counted: counted.append(1))
        trainer.train()
        # 8 micro-batches; under checkpointing each layer runs again in the backward
        assert len(counted) == 8 * (2 if settings else 1)
        runs.append([[log[key] for key in NOISE_KEYS] for log in step_logs(trainer)])
    assert len(runs[0]) == 2
    for plain, checkpointed in zip(*runs):
        assert checkpointed == pytest.approx(plain, rel=1e-5)


def test_steps_of_one_micro_batch_on_one_process_measure_nothing(make_trainer):
    trainer = make_trainer([AdaptiveBatch(micro_batch_size=8)], num_rows=24)
    trainer.train()
    assert logged(trainer, "adaptive_batch/accumulation_steps") == [1, 1, 1]
    assert not any(key in log for log in step_logs(trainer) for key in NOISE_KEYS)


def test_only_the_logs_of_steps_that_measured_carry_the_noise_keys(tmp_path):
    """Steps of 8, 16, then 8 samples in micro-batches of 8: only the steps of two micro-batches measure. The steps of
    one after them log no noise keys (not the last values again); `current()` keeps the averages as they stand."""
    callback = AdaptiveBatch(
        schedule=PhaseSchedule([8, 16, 8], boundaries=[32, 64], unit="samples"),
        micro_batch_size=8,
        noise_time_constant_samples=100,
    )
    trainer = regression_trainer(tmp_path, steps=12, effective=8, callback=callback, logging_steps=1)
    trainer.train()
    measured = [n == 2 for n in logged(trainer, "adaptive_batch/accumulation_steps")]
    assert measured == [False] * 4 + [True] * 2 + [False] * 4
    for key in ("adaptive_batch/grad_norm_sq", "adaptive_batch/grad_variance"):
        assert [key in log for log in step_logs(trainer)] == measured, key
    # the noise scale where the averaged |G|^2 is positive (here both measured steps)
    assert [key in log for log in step_logs(trainer) for key in NOISE_KEYS].count(True) == 6
    now = callback.current()
    last = step_logs(trainer)[5]
    assert now["noise_steps"] == 2 and now["step"] == 10
    assert [now[key.split("/")[1]] for key in NOISE_KEYS] == [last[key] for key in NOISE_KEYS]


def test_a_noise_scale_that_is_not_finite_is_left_out_and_no_log_carries_inf(tmp_path):
    """At the optimum (|G|^2 = 0) the averaged estimate of |G|^2 is as often negative as positive: the noise scale is
    then infinite, and its log holds the two averages without it."""
    callback = AdaptiveBatch(micro_batch_size=4, noise_time_constant_samples=8)
    trainer = regression_trainer(
        tmp_path, steps=16, effective=8, callback=callback, weight=REGRESSION_TARGET, logging_steps=1
    )
    trainer.train()
    logs = step_logs(trainer)
    assert all(math.isfinite(value) for log in logs for value in log.values() if isinstance(value, float))
    norm_sq = logged(trainer, "adaptive_batch/grad_norm_sq")  # every step measured: two micro-batches
    variance = logged(trainer, "adaptive_batch/grad_variance")
    assert any(x <= 0 for x in norm_sq) and any(x > 0 for x in norm_sq)  # both cases met
    assert logged_or_none(trainer, "adaptive_batch/noise_scale") == [
        max(v, 0.0) / n if n > 0 else None for n, v in zip(norm_sq, variance)
    ]


def test_a_micro_batch_that_ran_out_of_memory_is_not_counted(make_trainer):
    """The first step runs one micro-batch of 4, then the second runs out of memory (in its backward): the step is
    run again at 2, and its noise values are those of a run at 2 from the start, bit for bit. (No step ran to its end at
    4, so 4 is not tried again.)"""
    # padded rows, which the fake error counts (a causal LM's ragged rows run padding-free in rows by default)
    clean = make_trainer([AdaptiveBatch(micro_batch_size=2, padding_free=False)], num_rows=24)
    clean.train()
    retried = make_trainer([AdaptiveBatch(micro_batch_size=4, padding_free=False)], num_rows=24)
    watcher = FakeOutOfMemory(retried.model, max_rows=2, in_backward=True, only_after_calls=1)
    retried.train()
    assert watcher.raised == [4] and watcher.sizes[:3] == [4, 4, 2]
    for key in NOISE_KEYS + ("loss",):
        assert logged(retried, key) == logged(clean, key), key


def test_resuming_continues_the_noise_averages_bitwise(make_trainer, tmp_path):
    def run(output, resume=None):
        trainer = make_trainer(
            [AdaptiveBatch(micro_batch_size=3, noise_time_constant_samples=32)],
            num_rows=40,
            num_train_epochs=2,
            save_strategy="steps",
            save_steps=1,
            output_dir=str(output),
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full")
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-4"))

    def after(trainer, step):  # (`get`: a step whose averaged |G|^2 is not positive logs no noise_scale)
        return [{key: log.get(key) for key in NOISE_KEYS} for log in step_logs(trainer) if log["step"] > step]

    assert len(after(full, 4)) == 6
    assert after(resumed, 4) == after(full, 4)
