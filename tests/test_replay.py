"""Reproducible reruns (`AdaptiveBatch(replay=...)`): a run that reads an earlier run's recorded measurements makes
its decisions and is bit for bit that run, however differently its own clock runs; a record of another run is
refused before any compute."""

import json
import random

import pytest
import torch
from helpers import (
    QUIET_CPU_RUN,
    REGRESSION_NOISE_STD,
    REGRESSION_TARGET,
    REGRESSION_WEIGHT,
    LinearRegression,
    RegressionRows,
    adaptive_of,
    assert_same_parameters,
    logged,
    parameters,
    step_logs,
)

import adaptive_batch.hf.growth
import adaptive_batch.runtime.memory
from adaptive_batch import AdaptiveBatch, NoiseScaleSchedule
from adaptive_batch.core.replay import FILE
from adaptive_batch.testing import FakeOutOfMemory, tiny_llama

RECORD = FILE


class JitteryClock:
    """Stands for the `time` module where AdaptiveBatch reads the clock (`runtime.memory`'s `Stopwatch`, the growing
    schedule's step times): every reading is later by a draw of a seeded generator (`None`: by a constant), so two
    runs with other seeds measure other times for the same work."""

    def __init__(self, seed: int | None):
        self.random = random.Random(seed)
        self.seed, self.now = seed, 0.0

    def perf_counter(self) -> float:
        self.now += 0.001 if self.seed is None else self.random.uniform(0.001, 1.0)
        return self.now


def timed_by(monkeypatch, seed: int | None) -> JitteryClock:
    clock = JitteryClock(seed)
    monkeypatch.setattr(adaptive_batch.runtime.memory, "time", clock)
    monkeypatch.setattr(adaptive_batch.hf.growth, "time", clock)
    return clock


def cuts(trainer) -> list[tuple[int, int, int]]:
    """Each step's effective batch, largest micro-batch and micro-batches, as logged."""
    return [
        (
            log["adaptive_batch/effective_batch_size"],
            log["adaptive_batch/micro_batch_size"],
            log["adaptive_batch/accumulation_steps"],
        )
        for log in step_logs(trainer)
    ]


def assert_bitwise_equal(a, b) -> None:
    """The same losses and learning rates at every step, and the same final weights, bit for bit."""
    assert logged(a, "loss") == logged(b, "loss")
    assert logged(a, "learning_rate") == logged(b, "learning_rate")
    assert cuts(a) == cuts(b)
    assert_same_parameters(a.model, b.model)


@pytest.fixture
def ragged(rows):
    """48 rows of 3 to 32 tokens, mixed: "auto" cuts them by padded tokens at a measured overhead."""
    return [{"input_ids": row["input_ids"][: 3 + (11 * i) % 30]} for i, row in enumerate(rows[:48])]


RAGGED = dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, num_train_epochs=2)
# the padded token cut, which measures (under sdpa a causal LM's ragged rows run padding-free in rows by default)
BY_TOKENS = {"padding_free": False}
ROWS = dict(per_device_train_batch_size=2, gradient_accumulation_steps=8, num_train_epochs=1)


def run(make_trainer, monkeypatch, tmp_path, name, seed, dataset, settings, replay=None, resume=None, **args):
    timed_by(monkeypatch, seed)
    trainer = make_trainer(
        [AdaptiveBatch(replay=replay, **settings)], dataset=dataset, output_dir=str(tmp_path / name), **args
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.mark.parametrize(
    "case, settings",
    [
        ("ragged rows cut by tokens", BY_TOKENS),
        ("rows, micro_batch_size='auto'", {"micro_batch_size": "auto"}),
    ],
)
def test_a_replayed_run_is_bit_for_bit_the_recorded_one_whatever_its_clock_measures(
    make_trainer, monkeypatch, tmp_path, ragged, fixed_rows, case, settings
):
    dataset, args = (ragged, RAGGED) if case.startswith("ragged") else (fixed_rows[:64], ROWS)
    recorded = run(make_trainer, monkeypatch, tmp_path, "recorded", 1, dataset, settings, **args)
    assert (tmp_path / "recorded" / RECORD).is_file()
    # the same script on another moment of the machine: other times, other cuts
    again = run(make_trainer, monkeypatch, tmp_path, "again", 2, dataset, settings, **args)
    # (its logged losses may still come out equal where only a late step is cut otherwise)
    assert cuts(again) != cuts(recorded)
    # the same, replaying the record: the recorded run's cuts, losses and weights, bit for bit
    replayed = run(
        make_trainer,
        monkeypatch,
        tmp_path,
        "replayed",
        2,
        dataset,
        settings,
        replay=str(tmp_path / "recorded"),
        **args,
    )
    assert_bitwise_equal(replayed, recorded)
    assert adaptive_of(replayed).current() == adaptive_of(recorded).current()
    # the replay's own record is the recorded one's measurements
    own = json.loads((tmp_path / "replayed" / RECORD).read_text())
    assert own["streams"] == json.loads((tmp_path / "recorded" / RECORD).read_text())["streams"]
    assert own["replay_ended"] is None


def test_a_replay_killed_and_resumed_is_still_the_recorded_run(make_trainer, monkeypatch, tmp_path, ragged):
    """A checkpoint taken while the token cut still measures: resumed with the record, the steps after it read the
    recorded run's measurements of their own steps."""
    saving = dict(RAGGED, save_strategy="steps", save_steps=1)
    recorded = run(make_trainer, monkeypatch, tmp_path, "recorded", 1, ragged, BY_TOKENS, **saving)
    checkpoint = tmp_path / "recorded" / "checkpoint-2"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["stateful_callbacks"]["AdaptiveBatch"]["attributes"]["checkpoint"]["micro_batch"][
        "calibrating"
    ]
    unreplayed = run(
        make_trainer,
        monkeypatch,
        tmp_path,
        "unreplayed",
        2,
        ragged,
        BY_TOKENS,
        resume=str(checkpoint),
        **RAGGED,
    )
    # (a resumed Trainer's log history starts with the checkpoint's)
    assert cuts(unreplayed)[:2] == cuts(recorded)[:2] and cuts(unreplayed) != cuts(recorded)
    resumed = run(
        make_trainer,
        monkeypatch,
        tmp_path,
        "resumed",
        2,
        ragged,
        BY_TOKENS,
        replay=str(tmp_path / "recorded"),
        resume=str(checkpoint),
        **RAGGED,
    )
    assert_bitwise_equal(resumed, recorded)


def growing(tmp_path, name: str, replay=None):
    from transformers import Trainer, TrainingArguments

    schedule = NoiseScaleSchedule(16, max_size=128, min_samples_between_changes=320, min_efficiency=None)
    # one micro-batch a step (every fourth cut in two to measure the noise scale on one process)
    return Trainer(
        model=LinearRegression(REGRESSION_WEIGHT),
        args=TrainingArguments(
            output_dir=str(tmp_path / name),
            per_device_train_batch_size=16,
            num_train_epochs=1,
            learning_rate=0.05,
            lr_scheduler_type="constant",
            optim="sgd",
            max_grad_norm=0,
            **QUIET_CPU_RUN,
        ),
        train_dataset=RegressionRows(3200, REGRESSION_TARGET, REGRESSION_NOISE_STD),
        callbacks=[
            AdaptiveBatch(
                schedule=schedule,
                micro_batch_size=128,
                lr_scaling="sqrt",
                noise_time_constant_samples=320,
                replay=replay,
            )
        ],
    )


def test_a_replayed_noise_scale_schedule_grows_where_the_recorded_one_grew(tmp_path, monkeypatch):
    """Step times decide a `NoiseScaleSchedule`'s changes: steps that cost nothing more when larger grow the batch,
    steps that cost at random do otherwise; the replay grows as the record did."""
    clock = timed_by(monkeypatch, None)
    recorded = growing(tmp_path, "recorded")

    def forward_costs(module, args, kwargs):  # 1 s a micro-batch and 1 ms a row: a larger one pays
        clock.now += 1.0 + 0.001 * len(kwargs["x"])

    recorded.model.register_forward_pre_hook(forward_costs, with_kwargs=True)
    recorded.train()
    changes = adaptive_of(recorded).current()["batch_changes"]
    assert changes
    timed_by(monkeypatch, 3)
    again = growing(tmp_path, "again")
    again.train()
    assert adaptive_of(again).current()["batch_changes"] != changes
    timed_by(monkeypatch, 3)
    replayed = growing(tmp_path, "replayed", replay=str(tmp_path / "recorded" / RECORD))
    replayed.train()
    assert adaptive_of(replayed).current()["batch_changes"] == changes
    assert_bitwise_equal(replayed, recorded)


def test_a_record_of_another_run_is_refused_before_any_compute(
    make_trainer, monkeypatch, tmp_path, ragged, tokenizer
):
    recorded = run(make_trainer, monkeypatch, tmp_path, "recorded", 1, ragged, {}, **RAGGED)
    folder = str(tmp_path / "recorded")

    def refused(dataset, settings, **args):
        timed_by(monkeypatch, 2)
        model = tiny_llama(tokenizer)
        before = parameters(model)  # (cloned)
        with pytest.raises(ValueError) as error:  # (when the Trainer is built: AdaptiveBatch plans there)
            make_trainer(
                [AdaptiveBatch(replay=folder, **settings)],
                model=model,
                dataset=dataset,
                output_dir=str(tmp_path / "x"),
                **args,
            )
        # nothing ran: the weights as built, no record written
        assert all(torch.equal(before[name], value) for name, value in parameters(model).items())
        assert not (tmp_path / "x" / RECORD).exists()
        return str(error.value)

    message = refused(ragged[:40], {}, **RAGGED)
    assert "plan.dataset_size: 48 in the record, 40 now" in message and "fingerprint" not in message
    assert "leave replay out (replay=None)" in message
    message = refused(ragged, {}, **dict(RAGGED, per_device_train_batch_size=4))
    assert "plan.schedule" in message
    message = refused(ragged, {"micro_batch_overhead": 64}, **RAGGED)
    assert "settings.micro_batch_overhead: None in the record, 64 now" in message
    # a record of two processes, as one process's
    record = json.loads((tmp_path / "recorded" / RECORD).read_text())
    record["run"]["world_size"] = 2
    (tmp_path / "recorded" / RECORD).write_text(json.dumps(record))
    assert "world_size: 2 in the record, 1 now" in refused(ragged, {}, **RAGGED)
    assert recorded.state.global_step == 12


@pytest.mark.parametrize(
    "value, message",
    [(3, "must be the path"), ("", "must be the path")],
)
def test_a_bad_replay_setting_is_refused(value, message):
    with pytest.raises(ValueError, match=message):
        AdaptiveBatch(replay=value)


def test_a_missing_record_is_refused_naming_the_file(make_trainer, tmp_path, ragged):
    with pytest.raises(ValueError, match="there is no .*adaptive_batch_measurements.json"):
        make_trainer([AdaptiveBatch(replay=str(tmp_path / "nowhere"))], dataset=ragged, **RAGGED)


def test_a_recorded_out_of_memory_error_is_replayed_and_a_new_one_ends_the_replay(
    make_trainer, monkeypatch, tmp_path, fixed_rows, caplog
):
    """The recorded run ran out of memory above 4 rows: the replay, on a machine where everything fits, fails those
    micro-batches without running them and retries as that run did. A replay that meets an error the record does
    not hold goes on measuring for itself, with one warning."""
    dataset, settings = fixed_rows[:64], {"micro_batch_size": "auto"}
    timed_by(monkeypatch, 1)
    recorded = make_trainer(
        [AdaptiveBatch(**settings)], dataset=dataset, output_dir=str(tmp_path / "recorded"), **ROWS
    )
    FakeOutOfMemory(recorded.model, max_rows=4)
    recorded.train()
    record = json.loads((tmp_path / "recorded" / RECORD).read_text())
    assert any(entry[0].startswith("oom") for step in record["streams"]["train"].values() for entry in step)
    replayed = run(
        make_trainer,
        monkeypatch,
        tmp_path,
        "replayed",
        2,
        dataset,
        settings,
        replay=str(tmp_path / "recorded"),
        **ROWS,
    )
    assert_bitwise_equal(replayed, recorded)
    # a record without the error, replayed where it happens: the run survives it and says the replay ended
    clean = run(make_trainer, monkeypatch, tmp_path, "clean", 1, dataset, settings, **ROWS)
    timed_by(monkeypatch, 2)
    meets = make_trainer(
        [AdaptiveBatch(replay=str(tmp_path / "clean"), **settings)],
        dataset=dataset,
        output_dir=str(tmp_path / "meets"),
        **ROWS,
    )
    FakeOutOfMemory(meets.model, max_rows=4)
    with caplog.at_level("WARNING", logger="adaptive_batch"):
        meets.train()
    ended = [r.getMessage() for r in caplog.records if "the replay of" in r.getMessage()]
    assert len(ended) == 1 and "ran out of memory" in ended[0]
    assert json.loads((tmp_path / "meets" / RECORD).read_text())["replay_ended"] is not None
    assert (
        logged(meets, "adaptive_batch/samples_seen")[-1] == logged(clean, "adaptive_batch/samples_seen")[-1]
    )
