"""`adaptive-batch plot` and `adaptive_batch.cli.figure`: the series read back from a real run's saved log history, the
PNG, the command line and the errors."""

from __future__ import annotations

import json
import math
import shutil
import sys

import pytest
from helpers import QUIET_CPU_RUN

from adaptive_batch import AdaptiveBatch, PhaseSchedule
from adaptive_batch.cli.figure import (
    DPI,
    FIGURE_INCHES,
    PNG_NAME,
    TRAINING_KEYS,
    find_trainer_state,
    load_log_history,
    plot_run,
    read_series,
)
from adaptive_batch.cli.main import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_SHAPE = (round(FIGURE_INCHES[1] * DPI), round(FIGURE_INCHES[0] * DPI), 4)  # rows, columns, RGBA


@pytest.fixture(scope="module")
def run(tokenizer, rows, tmp_path_factory):
    """One short run, shared by the tests here: 64 samples at 4 -> 8 -> 16 per step (8 steps), a checkpoint
    every 4 steps and an evaluation every 5. Returns (output_dir, the live `trainer.state.log_history`)."""
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from adaptive_batch.testing import tiny_llama

    folder = tmp_path_factory.mktemp("plot")
    settings = dict(QUIET_CPU_RUN, save_strategy="steps", save_steps=4, eval_strategy="steps", eval_steps=5)
    trainer = Trainer(
        model=tiny_llama(tokenizer),
        args=TrainingArguments(
            output_dir=str(folder / "out"),
            per_device_train_batch_size=4,
            num_train_epochs=1,
            learning_rate=1e-2,
            **settings,
        ),
        train_dataset=rows[:64],
        eval_dataset=rows[100:108],
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        callbacks=[
            AdaptiveBatch(schedule=PhaseSchedule([4, 8, 16], boundaries=[0.25, 0.5]), lr_scaling="sqrt")
        ],
    )
    with (
        pytest.MonkeyPatch.context() as patch
    ):  # (the autouse probe-cache fixture is per test, not per module)
        patch.setenv("ADAPTIVE_BATCH_CACHE", str(folder / "probe-cache"))
        trainer.train()
    return folder / "out", trainer.state.log_history


def saved_copy(run, tmp_path):
    """A copy of the run's output dir that a test may change."""
    copy = tmp_path / "copy"
    shutil.copytree(run[0], copy)
    return copy


def test_the_series_are_the_logged_values_exactly(run):
    output_dir, history = run
    state_file = find_trainer_state(output_dir)
    assert state_file == output_dir / "checkpoint-8" / "trainer_state.json"
    series = read_series(load_log_history(state_file), source=str(state_file))
    training = [log for log in history if "adaptive_batch/samples_seen" in log]
    for name, key in TRAINING_KEYS.items():
        assert getattr(series, name) == [log.get(key) for log in training], name
    assert series.step == list(range(1, 9))
    assert series.samples_seen == [4, 8, 12, 16, 24, 32, 48, 64]
    assert series.effective_batch_size == [4, 4, 4, 4, 8, 8, 16, 16]
    assert all(isinstance(value, float) for value in series.loss + series.learning_rate)  # numbers, not text
    # the evaluations at steps 5 and 8 sit at the samples seen by then
    assert series.eval_step == [5, 8] and series.eval_samples_seen == [24, 64]
    assert series.eval_loss == [log["eval_loss"] for log in history if "eval_loss" in log]
    assert series.noise_measured == any(
        0 < log.get("adaptive_batch/noise_scale", 0) < math.inf for log in training
    )


def test_evaluations_between_training_logs_are_placed_by_step():
    history = [
        {"loss": 3.0, "adaptive_batch/samples_seen": 8, "adaptive_batch/effective_batch_size": 4, "step": 2},
        {"eval_loss": 2.9, "step": 1},
        {"eval_loss": 2.8, "step": 3},
        {"loss": 2.5, "adaptive_batch/samples_seen": 24, "adaptive_batch/effective_batch_size": 8, "step": 4},
        {"eval_loss": 2.7, "step": 4},
        {"eval_loss": 2.6, "step": 6},
        {"train_runtime": 1.0, "train_loss": 2.7, "step": 6},
    ]
    series = read_series(history)
    assert series.step == [2, 4] and series.loss == [3.0, 2.5]
    assert series.noise_scale == [None, None] and not series.noise_measured
    # step 1: half-way from (0, 0) to (2, 8); step 3: half-way to (4, 24); step 6: two more steps of 8
    assert series.eval_samples_seen == [4, 16, 24, 40]
    assert series.eval_loss == [2.9, 2.8, 2.7, 2.6]


@pytest.mark.parametrize("values, measured", [([None, 0.0, math.inf], False), ([None, math.inf, 12.5], True)])
def test_only_a_positive_finite_noise_scale_counts_as_measured(values, measured):
    history = [
        {"adaptive_batch/samples_seen": 4 * (k + 1), "adaptive_batch/noise_scale": v}
        for k, v in enumerate(values)
    ]
    assert read_series(history).noise_measured is measured


def test_the_png_has_the_stated_size(run):
    from matplotlib.image import imread

    png = plot_run(run[0])
    assert png == run[0] / PNG_NAME
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    assert imread(png).shape == PNG_SHAPE


def test_a_run_without_noise_scale_or_evaluations_still_draws_every_panel(run, tmp_path):
    from matplotlib.image import imread

    state_file = tmp_path / "trainer_state.json"
    history = [
        {key: value for key, value in log.items() if "noise" not in key and "grad_" not in key}
        for log in run[1]
        if "eval_loss" not in log
    ]
    state_file.write_text(json.dumps({"log_history": history}))
    png = plot_run(state_file, out=tmp_path / "pictures" / "run.png")
    assert png == tmp_path / "pictures" / "run.png" and imread(png).shape == PNG_SHAPE
    assert plot_run(state_file) == tmp_path / PNG_NAME  # next to a trainer_state.json passed itself


def test_the_root_trainer_state_wins_else_the_highest_checkpoint_step(run, tmp_path):
    copy = saved_copy(run, tmp_path)
    (copy / "checkpoint-4").rename(copy / "checkpoint-10")  # 10 > 8, though "checkpoint-10" < "checkpoint-8"
    (
        copy / "checkpoint-12"
    ).mkdir()  # a checkpoint without a trainer_state.json (a save cut short) is skipped
    assert find_trainer_state(copy) == copy / "checkpoint-10" / "trainer_state.json"
    shutil.copy(copy / "checkpoint-8" / "trainer_state.json", copy / "trainer_state.json")
    assert find_trainer_state(copy) == copy / "trainer_state.json"


def test_the_command_writes_the_png(run, tmp_path, capsys):
    out = tmp_path / "run.png"
    assert main(["plot", str(run[0]), "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result == {
        "png": str(out),
        "trainer_state": str(run[0] / "checkpoint-8" / "trainer_state.json"),
        "logged_steps": 8,
        "last_step": 8,
        "samples_seen": 64,
        "evaluations": 2,
        "noise_scale_measured": result["noise_scale_measured"],
    }
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    copy = saved_copy(run, tmp_path)
    assert main(["plot", str(copy)]) == 0
    assert capsys.readouterr().out.startswith(f"{copy / PNG_NAME}: 8 logged steps to step 8, 64 samples")
    assert (copy / PNG_NAME).read_bytes()[:8] == PNG_SIGNATURE


def without_plugin_keys(tmp_path, run):
    """The run's trainer_state.json as the plain Trainer would have written it."""
    history = [{k: v for k, v in log.items() if not k.startswith("adaptive_batch/")} for log in run[1]]
    return write_state(tmp_path, {"log_history": history})


def write_state(tmp_path, state):
    path = tmp_path / "trainer_state.json"
    path.write_text(json.dumps(state))
    return path


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda tmp_path, run: tmp_path / "missing", "missing does not exist; pass a Trainer output_dir"),
        (lambda tmp_path, run: tmp_path, "no trainer_state.json in "),
        (without_plugin_keys, "no adaptive_batch/samples_seen in the log history of "),
        (
            lambda tmp_path, run: write_state(tmp_path, {"log_history": []}),
            "(0 logs): was the run trained with AdaptiveBatch()?",
        ),
        (lambda tmp_path, run: write_state(tmp_path, {"global_step": 3}), "holds no log_history list"),
        (lambda tmp_path, run: tmp_path / "x.json", "x.json is not JSON"),
    ],
)
def test_what_cannot_be_drawn_is_one_line_and_a_non_zero_exit(run, tmp_path, capsys, make, message):
    (tmp_path / "x.json").write_text("{not json")
    path = make(tmp_path, run)
    with pytest.raises(ValueError) as error:
        plot_run(path)
    assert message in str(error.value)
    assert main(["plot", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("adaptive-batch: error:") and message in err


def test_without_matplotlib_the_error_says_what_to_install(run, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(
        sys.modules, "matplotlib.backends.backend_agg", None
    )  # import fails as if not installed
    with pytest.raises(ImportError, match=r'pip install "adaptive-batch\[plot\]"'):
        plot_run(run[0], out=tmp_path / "run.png")
    assert main(["plot", str(run[0]), "--out", str(tmp_path / "run.png")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'pip install "adaptive-batch[plot]"' in err
    assert not (tmp_path / "run.png").exists()
