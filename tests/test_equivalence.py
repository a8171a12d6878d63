"""Invariants 2 and 3: each step holds the planned samples, and how a step is cut does not change training.

Whole runs are compared with the ORDER_ONLY settings of helpers.py (float64, SGD), where the only differences left
are the order of floating-point additions.
"""

import pytest
import torch
from helpers import (
    ORDER_ONLY,
    ORDER_TOLERANCE,
    MeanLossModel,
    Recording,
    adaptive_of,
    assert_close_parameters,
    first_step_batch,
    logged,
    parameters,
)

from adaptive_batch import AdaptiveBatch, PhaseSchedule


def train(make_trainer, callbacks=(), **overrides):
    trainer = make_trainer(callbacks=callbacks, **overrides)
    trainer.train()
    return trainer


def test_same_as_the_plain_trainer_on_the_same_samples(make_trainer):
    sequential = dict(train_sampling_strategy="sequential", num_rows=48, num_train_epochs=2, **ORDER_ONLY)
    plain = train(make_trainer, **sequential)
    plugin = train(make_trainer, [AdaptiveBatch(micro_batch_size=3)], **sequential)
    assert plain.state.global_step == plugin.state.global_step == 12
    assert_close_parameters(parameters(plugin.model), parameters(plain.model))
    # the sample clock gives the plain schedule's step exactly when the batch is constant
    assert logged(plugin, "learning_rate") == logged(plain, "learning_rate")


def test_the_tolerance_is_far_below_what_one_sample_changes(make_trainer, rows):
    sequential = dict(train_sampling_strategy="sequential", num_train_epochs=2, **ORDER_ONLY)
    plain = train(make_trainer, dataset=rows[:48], **sequential)
    swapped = train(make_trainer, dataset=rows[:47] + [rows[48]], **sequential)  # one sample swapped
    worst = max(
        float((a - b).norm() / b.norm())
        for a, b in zip(parameters(swapped.model).values(), parameters(plain.model).values())
    )
    assert worst > 1e4 * ORDER_TOLERANCE  # a lost or repeated sample cannot hide under the tolerance


@pytest.mark.parametrize("per_device, accumulation", [(8, 1), (4, 2), (1, 8)])
def test_the_users_split_only_changes_the_micro_batches(make_trainer, per_device, accumulation):
    reference = train(make_trainer, [AdaptiveBatch(micro_batch_size=8)], num_rows=56, **ORDER_ONLY)
    trainer = train(
        make_trainer,
        [AdaptiveBatch()],
        num_rows=56,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        **ORDER_ONLY,
    )
    assert logged(trainer, "adaptive_batch/effective_batch_size") == [8] * 7
    assert_close_parameters(parameters(trainer.model), parameters(reference.model))


def test_adaptive_micro_batches_under_a_phase_schedule_match_whole_steps(make_trainer):
    schedule = PhaseSchedule([4, 8, 16], boundaries=[0.2, 0.5])
    common = dict(num_rows=60, **ORDER_ONLY)
    whole = train(make_trainer, [AdaptiveBatch(schedule=schedule, micro_batch_size=16)], **common)
    cut = train(make_trainer, [AdaptiveBatch(schedule=schedule, micro_batch_size=1)], **common)
    auto = train(make_trainer, [AdaptiveBatch(schedule=schedule)], per_device_train_batch_size=1, **common)
    steps = logged(whole, "adaptive_batch/effective_batch_size")
    assert steps == [4, 4, 4, 8, 8, 8, 16, 8]  # 12 -> 24 -> 60 samples; the last step is the epoch's rest
    assert len(set(logged(auto, "adaptive_batch/micro_batch_size"))) > 1  # "auto" changed sizes on the way
    assert_close_parameters(parameters(cut.model), parameters(whole.model))
    assert_close_parameters(parameters(auto.model), parameters(whole.model))


@pytest.mark.parametrize("micro_batch_size", [1, 3, 5, 8])
def test_accumulated_gradient_equals_one_full_batch_backward(make_trainer, micro_batch_size):
    trainer = make_trainer([AdaptiveBatch(micro_batch_size=micro_batch_size)], num_rows=40)
    model = trainer.model
    batch = first_step_batch(trainer)
    num_items = (batch["labels"][:, 1:] != -100).sum()

    loss = model(**batch, num_items_in_batch=num_items).loss
    loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    step_loss = trainer.training_step(model, batch, num_items)
    got = {name: p.grad.clone() for name, p in model.named_parameters()}
    assert adaptive_of(trainer).current()["accumulation_steps"] == -(-8 // micro_batch_size)
    assert torch.isclose(step_loss, loss.detach(), rtol=1e-5)
    assert_close_parameters(got, expected, rtol=1e-5)  # invariant 3, float32


def test_per_micro_batch_mean_losses_are_weighted_by_label_tokens(make_trainer, tokenizer):
    from adaptive_batch.testing import tiny_llama

    model = MeanLossModel(tiny_llama(tokenizer))
    trainer = make_trainer([AdaptiveBatch(micro_batch_size=3)], model=model, num_rows=40)
    assert not trainer.model_accepts_loss_kwargs
    batch = first_step_batch(trainer)
    model(**batch)["loss"].backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    trainer.training_step(model, batch, None)
    assert_close_parameters({n: p.grad for n, p in model.named_parameters()}, expected, rtol=1e-5)


@pytest.mark.parametrize(
    "sizes, expected",
    [([4, 12], [4] * 12 + [2] + [12] * 4 + [2]), ([12, 4], [12] * 4 + [2] + [4] * 12 + [2])],
    ids=["growing", "shrinking"],
)
def test_each_step_trains_on_exactly_the_planned_samples(make_trainer, rows, sizes, expected):
    trainer = make_trainer(
        [AdaptiveBatch(schedule=PhaseSchedule(sizes, boundaries=[0.5]), micro_batch_size=5)],
        trainer_class=Recording,
        num_rows=50,
        num_train_epochs=2,
    )
    trainer.train()
    plan = adaptive_of(trainer).plan
    sampler = trainer.get_train_dataloader().batch_sampler.steps  # (in the slots of the loop)
    trained = [[] for _ in range(plan.num_steps)]
    for step, _, _, _, content in trainer.micro_batches:
        assert len(content) <= 5
        trained[step].extend(content)
    planned = [[tuple(rows[i]["input_ids"]) for i in sampler.indices(k)] for k in range(plan.num_steps)]
    assert [sorted(step) for step in trained] == [sorted(step) for step in planned]
    assert [len(step) for step in trained] == list(plan.sizes) == expected
    assert logged(trainer, "adaptive_batch/effective_batch_size") == list(plan.sizes)
    for epoch in (0, 1):
        epoch_rows = [r for k, step in enumerate(trained) if plan.epoch(k) == epoch for r in step]
        assert sorted(epoch_rows) == sorted(tuple(r["input_ids"]) for r in rows[:50])
