"""No trace: with AdaptiveBatch the user's objects stay the user's. Callbacks, trackers and checkpoints read the
user's arguments; a loss that ignores `num_items_in_batch` keeps the plain Trainer's scale; nothing of another
library is changed for the process (two Trainers in one process each behave as alone); the package's logger is
configured as a library's."""

import json
import logging
import subprocess
import sys
import threading

import pytest
import torch
from helpers import (
    ORDER_ONLY,
    assert_close_parameters,
    assert_same_parameters,
    parameters,
    step_logs,
)
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import TrainerState

from adaptive_batch import AdaptiveBatch, PhaseSchedule

# 40 rows, 4 x 2 a step: 5 steps of 8
RUN = dict(num_rows=40, per_device_train_batch_size=4, gradient_accumulation_steps=2)


class ArgsSeen(TrainerCallback):
    """Records the arguments every event of training is given, and counts the loop's substeps."""

    EVENTS = ("on_train_begin", "on_step_begin", "on_substep_end", "on_step_end", "on_log", "on_save")

    def __init__(self):
        self.seen: list[tuple[str, str]] = []
        self.substeps = 0
        for event in self.EVENTS:
            setattr(self, event, self._recorder(event))

    def _recorder(self, event):
        def record(args, state, control, **kwargs):
            self.seen.append((event, args.to_json_string()))
            self.substeps += event == "on_substep_end"

        return record


def test_callbacks_trackers_and_checkpoints_read_the_users_arguments(make_trainer, tmp_path):
    def run(callbacks, name):
        seen = ArgsSeen()
        trainer = make_trainer(
            [*callbacks, seen],
            output_dir=str(tmp_path / name),
            save_strategy="steps",
            save_steps=2,
            **RUN,
        )
        before = trainer.args.to_json_string()
        trainer.train()
        return trainer, seen, before

    plain, plain_seen, _ = run([], "plain")
    ours, seen, before = run([AdaptiveBatch(micro_batch_size=3)], "ours")
    assert {event for event, _ in seen.seen} == set(ArgsSeen.EVENTS)
    assert all(args == before for _, args in seen.seen)  # every event, every step
    assert json.loads(before)["gradient_accumulation_steps"] == 2
    # the loop's substeps (what callbacks count between optimizer steps) are the plain Trainer's
    assert seen.substeps == plain_seen.substeps == 5 * (2 - 1)
    assert ours.state.global_step == plain.state.global_step == 5

    # a checkpoint's training_args.bin is the user's, and `plan` on it plans the run that happened
    saved = torch.load(tmp_path / "ours" / "checkpoint-2" / "training_args.bin", weights_only=False)
    assert saved.to_json_string() == before
    # (in a process of its own, as a user runs it: its stdout is the one JSON object)
    argv = [
        "plan",
        "--dataset-size",
        "40",
        "--args",
        str(tmp_path / "ours" / "checkpoint-2" / "training_args.bin"),
    ]
    command = f"from adaptive_batch.cli.main import main; raise SystemExit(main({[*argv, '--json']!r}))"
    done = subprocess.run([sys.executable, "-c", command], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    planned = json.loads(done.stdout)
    assert planned["starting_effective_batch_size"] == 8
    assert planned["optimizer_steps"] == ours.state.global_step


# -- a loss that ignores num_items_in_batch ------------------------------------------------------------------------


class MeanLossOverride(Trainer):
    """An older pattern: `compute_loss` returns the model's own mean loss and ignores `num_items_in_batch`."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


def mean_causal_lm_loss(outputs, labels, num_items_in_batch=None):
    """A `compute_loss_func` that ignores `num_items_in_batch`: the micro-batch's mean over its label tokens."""
    logits = outputs.logits[:, :-1]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )


class MeanLossFunc(Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, compute_loss_func=mean_causal_lm_loss, **kwargs)


@pytest.mark.parametrize("trainer_class", [MeanLossOverride, MeanLossFunc])
def test_a_loss_that_ignores_num_items_has_the_plain_scale_whatever_the_cut(
    make_trainer, fixed_rows, caplog, trainer_class
):
    # rows of one length: the plain Trainer's step loss, the sum of its 2 micro-batch means, is 2 x the step's mean
    # exactly; a budget of 3 rows cuts each step of 8 into 3 + 3 + 2 (the fixed time of a micro-batch far above a
    # row's, so the fewest micro-batches are cheapest)
    settings = dict(RUN, dataset=fixed_rows[:40], trainer_class=trainer_class, **ORDER_ONLY)
    plain = make_trainer(**settings)
    plain.train()
    adaptive = AdaptiveBatch(max_tokens_per_micro_batch=3 * 32, micro_batch_overhead=10**6)
    with caplog.at_level(logging.WARNING, logger="adaptive_batch"):
        ours = make_trainer([adaptive], **settings)
        ours.train()
    assert [log["adaptive_batch/accumulation_steps"] for log in step_logs(ours)] == [3] * 5
    for a, b in zip(step_logs(ours), step_logs(plain), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)  # (the Trainer sums logged losses in float32)
    assert_close_parameters(parameters(ours.model), parameters(plain.model))
    warned = [r.getMessage() for r in caplog.records if "does not use num_items_in_batch" in r.getMessage()]
    assert len(warned) == 1  # once per run, naming what to do for an exact token mean
    assert "divide by num_items_in_batch" in warned[0]


# -- nothing changed for the process ---------------------------------------------------------------------------------


class Pause(TrainerCallback):
    """Holds its Trainer inside `train()` after its first step until `release` is set."""

    def __init__(self):
        self.inside, self.release = threading.Event(), threading.Event()

    def on_step_end(self, args, state, control, **kwargs):
        if not self.inside.is_set():
            self.inside.set()
            assert self.release.wait(120), "the test never released the paused Trainer"


def test_two_trainers_in_one_process_each_behave_as_alone(make_trainer, tmp_path):
    # a checkpoint a plain Trainer would resume elsewhere (the batch grew): it refuses it, naming why
    grown = dict(RUN, num_rows=60, num_train_epochs=2, save_strategy="steps", save_steps=10, **ORDER_ONLY)
    schedule = dict(schedule=PhaseSchedule([8, 16], boundaries=[0.5]), micro_batch_size=4)
    whole = make_trainer([AdaptiveBatch(**schedule)], output_dir=str(tmp_path / "whole"), **grown)
    whole.train()
    checkpoint = str(tmp_path / "whole" / "checkpoint-10")
    alone_settings = dict(RUN, train_sampling_strategy="sequential", **ORDER_ONLY)
    alone = make_trainer(output_dir=str(tmp_path / "alone"), **alone_settings)
    alone.train()
    load_from_json = TrainerState.__dict__["load_from_json"]

    # one Trainer with AdaptiveBatch resumes that checkpoint in a thread, and is held inside train()
    pause = Pause()
    resumed = make_trainer([AdaptiveBatch(**schedule), pause], output_dir=str(tmp_path / "resumed"), **grown)
    plain_refusing = make_trainer(output_dir=str(tmp_path / "refusing"), **grown)
    plain_beside = make_trainer(output_dir=str(tmp_path / "beside"), **alone_settings)
    errors = []

    def resume():
        try:
            resumed.train(resume_from_checkpoint=checkpoint)
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)
            pause.inside.set()

    thread = threading.Thread(target=resume)
    thread.start()
    try:
        assert pause.inside.wait(120) and not errors, errors
        # while it trains: no class of another library is changed, and Trainers without it behave as alone
        assert TrainerState.__dict__["load_from_json"] is load_from_json
        with pytest.raises(TypeError, match="a Trainer without AdaptiveBatch would resume this checkpoint"):
            plain_refusing.train(resume_from_checkpoint=checkpoint)
        plain_beside.train()
        assert plain_beside.args.gradient_accumulation_steps == 2
    finally:
        pause.release.set()
        thread.join(120)
    assert not errors, errors
    assert_same_parameters(plain_beside.model, alone.model)
    assert_close_parameters(parameters(resumed.model), parameters(whole.model))

    # and one after the other
    after = make_trainer(output_dir=str(tmp_path / "after"), **alone_settings)
    after.train()
    assert_same_parameters(after.model, alone.model)
    assert type(after) is Trainer


def test_the_package_logger_is_configured_as_a_librarys(make_trainer):
    make_trainer([AdaptiveBatch()], **RUN).train()
    package = logging.getLogger("adaptive_batch")
    assert package.propagate
    assert any(isinstance(handler, logging.NullHandler) for handler in package.handlers)

    # logging configured afterwards receives the records, once each
    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    root = logging.getLogger()
    handler = Collect(level=logging.INFO)
    root.addHandler(handler)
    try:
        make_trainer([AdaptiveBatch()], **RUN).train()
    finally:
        root.removeHandler(handler)
    plan_tables = [message for message in records if "optimizer steps" in message]
    assert len(plan_tables) == 1


SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import helpers
from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments
from adaptive_batch import AdaptiveBatch
from adaptive_batch.testing import text_corpus, tiny_llama, token_dataset, train_tokenizer

texts = text_corpus()
tokenizer = train_tokenizer(texts[:300], vocab_size=256)
rows = token_dataset(tokenizer, texts[:40], max_length=16)
args = TrainingArguments(output_dir={out!r}, per_device_train_batch_size=4, max_steps=2, **helpers.QUIET_CPU_RUN)
collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
Trainer(model=tiny_llama(tokenizer), args=args, train_dataset=rows, data_collator=collator,
        callbacks=[AdaptiveBatch()]).train()
"""


def test_a_script_that_configures_no_logging_shows_the_plan_table(tmp_path):
    from pathlib import Path

    script = SCRIPT.format(tests=str(Path(__file__).parent), out=str(tmp_path / "out"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("optimizer steps") == 1  # the plan table, once
