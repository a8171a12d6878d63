"""The scheduler and optimizer as the caller built them: an explicit `num_training_steps` outside `train()`, the
Trainer's own scheduler object at a constant batch, Adafactor's relative-step LR, a Trainer without a training
dataset; a changing batch's scheduler keeps its lambdas' attributes readable."""

from __future__ import annotations

import pytest
from helpers import step_logs
from transformers import Trainer
from transformers.optimization import Adafactor, AdafactorSchedule

from adaptive_batch import AdaptiveBatch, PhaseSchedule

MIN_LR = dict(lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": 1e-5}, learning_rate=0.2)


def lrs_over(scheduler, steps: int) -> list[float]:
    lrs = []
    for _ in range(steps):
        scheduler.optimizer.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    return lrs


@pytest.mark.parametrize("with_dataset", [True, False])
def test_an_explicit_num_training_steps_builds_the_plain_trainers_scheduler(make_trainer, rows, with_dataset):
    def built(callbacks):
        trainer = make_trainer(callbacks, **MIN_LR)
        if not with_dataset:  # (the same model and arguments, no train_dataset)
            trainer = Trainer(
                model=trainer.model, args=trainer.args, callbacks=[type(c)() for c in callbacks]
            )
        trainer.create_optimizer_and_scheduler(num_training_steps=10)
        return trainer.lr_scheduler

    plain, ours = built([]), built([AdaptiveBatch()])
    assert type(ours) is type(plain)
    assert ours.lr_lambdas[0].keywords == plain.lr_lambdas[0].keywords
    assert ours.lr_lambdas[0].keywords["num_training_steps"] == 10
    assert lrs_over(ours, 10) == lrs_over(plain, 10)
    assert ours.get_last_lr()[0] == pytest.approx(1e-5)


def test_a_constant_batch_trains_with_the_trainers_own_scheduler(make_trainer):
    def trained(callbacks):
        trainer = make_trainer(callbacks, num_rows=36, num_train_epochs=2, **MIN_LR)
        trainer.train()
        return trainer

    plain, ours = trained([]), trained([AdaptiveBatch(micro_batch_size=1)])
    assert type(ours.lr_scheduler) is type(plain.lr_scheduler)
    assert ours.lr_scheduler.lr_lambdas[0].keywords == plain.lr_scheduler.lr_lambdas[0].keywords
    assert [log["learning_rate"] for log in step_logs(ours)] == [
        log["learning_rate"] for log in step_logs(plain)
    ]


def test_adafactors_relative_step_lr_is_logged_as_under_the_plain_trainer(make_trainer):
    def trained(callbacks):
        trainer = make_trainer(callbacks, num_rows=24, logging_steps=1)
        optimizer = Adafactor(trainer.model.parameters(), relative_step=True, warmup_init=True, lr=None)
        trainer.optimizer, trainer.lr_scheduler = optimizer, AdafactorSchedule(optimizer)
        trainer.train()
        return [log["learning_rate"] for log in step_logs(trainer)]

    plain = trained([])
    assert plain[0] == 0 and plain[1] > 0  # (the first is read before Adafactor's first step)
    # the same up to the parameters' rounding (the relative step reads their root mean square)
    assert trained([AdaptiveBatch(micro_batch_size=2)]) == pytest.approx(plain, rel=1e-5)


def test_under_a_growing_batch_adafactors_schedule_is_refused_naming_it(make_trainer):
    trainer = make_trainer([AdaptiveBatch(schedule=PhaseSchedule([4, 8], boundaries=[0.5]))], num_rows=24)
    optimizer = Adafactor(trainer.model.parameters(), relative_step=True, warmup_init=True, lr=None)
    trainer.optimizer, trainer.lr_scheduler = optimizer, AdafactorSchedule(optimizer)
    with pytest.raises(ValueError, match="AdafactorSchedule cannot follow a changing effective batch"):
        trainer.train()


def test_a_growing_batchs_scheduler_keeps_its_lambdas_attributes_readable(make_trainer):
    trainer = make_trainer(
        [AdaptiveBatch(schedule=PhaseSchedule([4, 8], boundaries=[0.5]))], num_rows=24, **MIN_LR
    )
    trainer.train()
    keywords = trainer.lr_scheduler.lr_lambdas[0].keywords
    # the schedule's length: the plain Trainer's steps at the starting batch of 4 (24 rows, one epoch)
    assert keywords["min_lr_rate"] == 1e-5 / 0.2 and keywords["num_training_steps"] == 6
