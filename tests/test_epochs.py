"""Epoch events as the plain Trainer sends them: every callback event of a run, in order, with the step and epoch it
came at, against the plain Trainer's run (a constant batch), and at each data epoch's start and end under a growing
batch."""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback

from adaptive_batch import AdaptiveBatch, PhaseSchedule

EVENTS = [
    name
    for name in vars(TrainerCallback)
    if name.startswith("on_") and name not in ("on_init_end", "on_push_begin")
]


class EventLog(TrainerCallback):
    """Every event after the Trainer is built: (event, global step, epoch), the epoch rounded to 12 digits."""

    def __init__(self):
        self.events: list[tuple[str, int, float | None]] = []

    def __getattribute__(self, name):
        if name in EVENTS:
            events = object.__getattribute__(self, "events")

            def record(args, state, control, **kwargs):
                epoch = None if state.epoch is None else round(state.epoch, 12)
                events.append((name, state.global_step, epoch))

            return record
        return object.__getattribute__(self, name)


def epoch_run(make_trainer, rows, tmp_path, name, callbacks, **settings):
    events = EventLog()
    trainer = make_trainer(
        [*callbacks, events],
        num_train_epochs=3,
        eval_strategy="epoch",
        save_strategy="epoch",
        logging_strategy="epoch",
        eval_dataset=rows[100:108],
        output_dir=str(tmp_path / name),
        **settings,
    )
    trainer.train()
    return events.events


def epochs_of(events) -> list[tuple[str, int, float]]:
    return [event for event in events if event[0] in ("on_epoch_begin", "on_epoch_end")]


@pytest.mark.parametrize("num_rows", [32, 36])  # 4 steps of 8 an epoch; 5 steps, the last of 4
@pytest.mark.parametrize("micro_batch_size", [1, None])  # (None: the whole step of 8)
def test_a_constant_batch_sends_the_plain_trainers_events_in_order(
    make_trainer, rows, tmp_path, num_rows, micro_batch_size
):
    settings = dict(num_rows=num_rows, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    plain = epoch_run(make_trainer, rows, tmp_path, "plain", [], **settings)
    adaptive = AdaptiveBatch(micro_batch_size=micro_batch_size or 8)
    ours = epoch_run(make_trainer, rows, tmp_path, "adaptive", [adaptive], **settings)
    assert [event[0] for event in epochs_of(plain)] == ["on_epoch_begin", "on_epoch_end"] * 3
    assert ours == plain


def test_a_growing_batch_sends_each_epochs_events_where_its_data_starts_and_ends(
    make_trainer, rows, tmp_path
):
    adaptive = AdaptiveBatch(schedule=PhaseSchedule([4, 8], boundaries=[0.5]))
    events = epoch_run(make_trainer, rows, tmp_path, "adaptive", [adaptive], num_rows=36)
    plan = adaptive.plan
    ends = [step + 1 for step in range(plan.num_steps) if plan.ends_epoch(step)]
    assert len(set(plan.sizes)) == 2 and len(ends) == 3
    begins = [0, *ends[:-1]]
    expected = []
    for epoch, (begin, end) in enumerate(zip(begins, ends)):
        expected += [
            ("on_epoch_begin", begin, float(epoch)),
            ("on_epoch_end", end, epoch + 1.0),
        ]
    assert epochs_of(events) == expected
    # each epoch's end is logged, evaluated and saved, after its on_epoch_end, and nowhere else
    names = [event[0] for event in events if event[0] != "on_prediction_step"]
    after = [names[index + 1 : index + 5] for index, name in enumerate(names) if name == "on_epoch_end"]
    assert after == [["on_log", "on_log", "on_evaluate", "on_save"]] * 3
    assert names.count("on_evaluate") == names.count("on_save") == 3
    assert [event[0] for event in events].count("on_step_begin") == plan.num_steps


@pytest.mark.parametrize("resume_at", [7, 10])  # inside the second epoch; at its end (5 steps an epoch)
def test_a_resumed_run_sends_the_plain_trainers_events_from_where_it_resumes(
    make_trainer, rows, tmp_path, resume_at
):
    def resumed(name, callbacks):
        settings = dict(num_rows=36, num_train_epochs=3, save_strategy="steps", save_steps=1)
        make_trainer(callbacks, output_dir=str(tmp_path / name), **settings).train()
        events = EventLog()
        trainer = make_trainer([*callbacks, events], output_dir=str(tmp_path / f"{name}-2"), **settings)
        trainer.train(resume_from_checkpoint=str(tmp_path / name / f"checkpoint-{resume_at}"))
        return events.events

    plain = resumed("plain", [])
    assert plain[1][:2] == ("on_epoch_begin", resume_at)
    assert resumed("adaptive", [AdaptiveBatch(micro_batch_size=2)]) == plain


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


def test_a_stream_sends_the_plain_trainers_events(make_trainer, rows, tmp_path):
    def run(name, callbacks):
        events = EventLog()
        settings = dict(max_steps=6, logging_steps=2, save_steps=3, eval_strategy="steps", eval_steps=3)
        output_dir = str(tmp_path / name)
        stream, evaluated = Stream(rows[:60]), rows[100:108]
        make_trainer(
            [*callbacks, events], dataset=stream, eval_dataset=evaluated, output_dir=output_dir, **settings
        ).train()
        return events.events

    assert run("adaptive", [AdaptiveBatch(micro_batch_size=2)]) == run("plain", [])


class ReadsTheDataloader(TrainerCallback):
    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        self.read = (train_dataloader.total_batch_size, train_dataloader.total_dataset_length)
        self.has_set_epoch = callable(getattr(train_dataloader, "set_epoch", None))


def test_the_train_dataloader_answers_what_accelerates_does(make_trainer):
    def read(callbacks):
        reader = ReadsTheDataloader()
        make_trainer([*callbacks, reader], num_rows=20, max_steps=1).train()
        return reader

    plain, ours = read([]), read([AdaptiveBatch(micro_batch_size=1)])
    assert ours.read == plain.read == (4, 20)
    assert ours.has_set_epoch and plain.has_set_epoch
