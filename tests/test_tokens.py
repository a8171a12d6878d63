"""Cutting steps by a token budget (`max_tokens_per_micro_batch`): micro-batches hold at most that many padded
tokens, their row counts vary with the lengths, an out-of-memory error halves the budget, and training is the same
as one whole batch per step. (The tiny Llama is a causal LM under sdpa, whose ragged rows run padding-free in rows
by default, so the tests of the padded cut that the library's own training_step runs state `padding_free=False`.)"""

import itertools
import json
import random

import pytest
import torch
from helpers import (
    ORDER_ONLY,
    MeanLossModel,
    Recording,
    adaptive_of,
    assert_close_parameters,
    assert_same_parameters,
    first_step_batch,
    parameters,
    saved_state,
    step_logs,
)

from adaptive_batch import AdaptiveBatch, MicroBatchTooLargeError
from adaptive_batch.core.tokens import CALIBRATION_STEPS, TokenController
from adaptive_batch.runtime.batch import IGNORE_INDEX, StepBatch
from adaptive_batch.testing import FakeOutOfMemory

BUDGET = 64
# a stated overhead above any step's tokens: the cut is the fewest micro-batches, whatever a measurement would say
FEWEST = 10**6


def padded_batch(lengths: list[int], left: bool = False) -> dict[str, torch.Tensor]:
    """A collated causal-LM batch of rows with these real lengths, padded to the longest (right, or left)."""
    width = max(lengths)
    positions = torch.arange(width)
    mask = torch.stack([positions < n for n in lengths]).long()
    if left:
        mask = mask.flip(1)
    input_ids = torch.randint(2, 100, (len(lengths), width)) * mask
    labels = input_ids.masked_fill(mask == 0, IGNORE_INDEX)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def padded_tokens(batch: StepBatch, sizes: list[int]) -> list[int]:
    """Tokens of each micro-batch as `take` builds it, counted on the tensors themselves."""
    counts, start = [], 0
    for size in sizes:
        counts.append(batch.take(start, size)["input_ids"].numel())
        start += size
    return counts


def fewest_micro_batches(batch: StepBatch, budget: int, row_cap: int | None) -> int:
    """Brute force over every way to cut the longest-first order into consecutive micro-batches."""
    best = [0] + [batch.rows + 1] * batch.rows  # best[i]: fewest micro-batches for the first i rows
    for end in range(1, batch.rows + 1):
        for start in range(end):
            size = end - start
            tokens = batch.take(start, size)["input_ids"].numel()
            if (size == 1 or tokens <= budget) and (row_cap is None or size <= row_cap):
                best[end] = min(best[end], best[start] + 1)
    return best[batch.rows]


# -- cutting one step ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "budget, row_cap, expected, tokens",
    [
        (60, None, [1, 2, 3], [30, 40, 30]),  # as many as fit would give 2, 3, 1 (60, 60, 10)
        (100, None, [2, 4], [60, 80]),  # as many as fit would give 3, 3 (90, 30)
        (1000, None, [6], [180]),
        (1000, 4, [2, 4], [60, 80]),
        (1000, 2, [2, 2, 2], [60, 40, 20]),
        (25, None, [1, 1, 1, 2, 1], [30, 20, 20, 20, 10]),  # the row of 30 runs alone
    ],
)
def test_a_step_is_cut_into_the_fewest_micro_batches_with_the_lowest_peak(budget, row_cap, expected, tokens):
    batch = StepBatch(padded_batch([10, 30, 10, 20, 10, 20]))
    sizes = batch.token_chunks(budget, row_cap)
    assert sizes == expected
    assert padded_tokens(batch, sizes) == tokens
    starts = [0, *itertools.accumulate(sizes)][:-1]
    assert [batch.tokens(start, size)[1] for start, size in zip(starts, sizes)] == tokens


def test_the_budget_holds_for_any_lengths_and_no_cut_has_fewer_micro_batches():
    generator = random.Random(0)
    torch.manual_seed(0)
    for _ in range(60):
        lengths = [generator.randint(1, 40) for _ in range(generator.randint(1, 12))]
        batch = StepBatch(padded_batch(lengths))
        budget = generator.randint(1, 200)
        row_cap = generator.choice([None, 1, 2, 3, 5])
        sizes = batch.token_chunks(budget, row_cap)
        assert sum(sizes) == len(lengths)
        for size, tokens in zip(sizes, padded_tokens(batch, sizes)):
            assert size == 1 or tokens <= budget, (lengths, budget, sizes)
            assert row_cap is None or size <= row_cap
        assert len(sizes) == fewest_micro_batches(batch, budget, row_cap), (lengths, budget, row_cap)


def test_a_row_longer_than_the_budget_runs_alone():
    batch = StepBatch(padded_batch([10, 50, 10, 10]))
    assert batch.longest_row() == 50
    sizes = batch.token_chunks(40)
    assert sizes == [1, 3]
    assert padded_tokens(batch, sizes) == [50, 30]


def test_left_padding_that_cannot_be_cut_counts_the_whole_length():
    batch = StepBatch(padded_batch([10, 30, 10, 20, 10, 20], left=True))
    assert not batch.trimmable
    sizes = batch.token_chunks(70)
    assert sizes == [2, 2, 2]
    assert padded_tokens(batch, sizes) == [60, 60, 60]


# -- settings and state ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -64, 64.0, "4096", True])
def test_a_budget_that_is_not_a_positive_int_is_refused(value):
    with pytest.raises(ValueError) as error:
        AdaptiveBatch(max_tokens_per_micro_batch=value)
    message = str(error.value)
    assert message.startswith(f"max_tokens_per_micro_batch={value!r} must be a positive int")
    assert "e.g. 16384" in message and "\n" not in message


def test_the_controller_holds_the_budget_and_halves_it_on_out_of_memory():
    controller = TokenController(BUDGET, 8, overhead=FEWEST)
    assert not controller.exploring and controller.settled_because == "cut by max_tokens_per_micro_batch"
    controller.on_out_of_memory(4, padded_tokens=60)
    assert controller.max_tokens == 30
    controller.on_out_of_memory(2, padded_tokens=64)  # never raised again by a larger failure
    assert controller.max_tokens == 30
    saved = json.loads(json.dumps(controller.state_dict()))
    restored = TokenController(BUDGET, 8, overhead=FEWEST)
    restored.load_state_dict(saved)
    assert restored.max_tokens == 30 and restored.oom_sizes == [4, 2]
    with pytest.raises(MicroBatchTooLargeError) as error:
        controller.on_out_of_memory(1, padded_tokens=20)
    assert error.value.tried == [4, 2, 1]


# -- training --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def varied(rows):
    """Rows cut to lengths from 3 to 32 tokens, well mixed, so that steps hold rows of very different lengths."""
    return [{"input_ids": row["input_ids"][: 3 + (11 * i) % 30]} for i, row in enumerate(rows[:48])]


SETTINGS = dict(
    per_device_train_batch_size=8,
    gradient_accumulation_steps=1,
    num_train_epochs=2,
    train_sampling_strategy="sequential",
    **ORDER_ONLY,
)


def train(make_trainer, varied, callbacks=(), **overrides):
    settings = dict(SETTINGS, dataset=varied, trainer_class=Recording)
    trainer = make_trainer(callbacks, **{**settings, **overrides})
    trainer.train()
    return trainer


def test_training_by_tokens_is_the_plain_trainer_with_whole_steps(make_trainer, varied):
    plain = train(make_trainer, varied)
    cut = train(make_trainer, varied, [AdaptiveBatch(max_tokens_per_micro_batch=BUDGET)])
    assert {rows for _, rows, *_ in plain.micro_batches} == {8}
    assert all(rows == 1 or rows * length <= BUDGET for _, rows, length, *_ in cut.micro_batches)
    assert len({rows for _, rows, *_ in cut.micro_batches}) >= 3  # the lengths decide the rows
    per_step = [[rows for step, rows, *_ in cut.micro_batches if step == k] for k in range(12)]
    assert [sum(rows) for rows in per_step] == [8] * 12
    logs = step_logs(cut)
    assert [log["adaptive_batch/micro_batch_size"] for log in logs] == [max(rows) for rows in per_step]
    assert [log["adaptive_batch/accumulation_steps"] for log in logs] == [len(rows) for rows in per_step]
    assert [log["adaptive_batch/effective_batch_size"] for log in logs] == [8] * 12
    assert_close_parameters(parameters(cut.model), parameters(plain.model))


def test_an_int_micro_batch_size_caps_the_rows(make_trainer, varied):
    trainer = train(
        make_trainer,
        varied,
        [AdaptiveBatch(max_tokens_per_micro_batch=1000, micro_batch_size=3, micro_batch_overhead=FEWEST)],
    )
    per_step = [[rows for step, rows, *_ in trainer.micro_batches if step == k] for k in range(12)]
    # 1,000 tokens would hold the whole step: 3 rows at most make 3 micro-batches of the 8 rows
    assert all(sum(rows) == 8 and len(rows) == 3 and max(rows) == 3 for rows in per_step), per_step


@pytest.mark.parametrize("mean_loss", [False, True])
def test_the_gradient_of_a_step_cut_by_tokens_is_the_whole_batch_gradient(
    make_trainer, tokenizer, varied, mean_loss
):
    from adaptive_batch.testing import tiny_llama

    # every labelled position scored (no shift): the step's mean is over exactly the label tokens the weights count
    model = MeanLossModel(tiny_llama(tokenizer), shift=False) if mean_loss else tiny_llama(tokenizer)
    trainer = make_trainer(
        [AdaptiveBatch(max_tokens_per_micro_batch=BUDGET, padding_free=False)],
        model=model,
        dataset=varied,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=1,
    )
    batch = first_step_batch(trainer)
    num_items = None if mean_loss else (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
    extra = {} if mean_loss else {"num_items_in_batch": num_items}
    loss = model(**batch, **extra)["loss"]
    loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    step_loss = trainer.training_step(model, batch, num_items)
    sizes = StepBatch(batch).token_chunks(BUDGET)
    assert len(set(sizes)) > 1 and adaptive_of(trainer).current()["accumulation_steps"] == len(sizes)
    if not mean_loss:
        assert torch.isclose(step_loss, loss.detach(), rtol=1e-5)
    assert_close_parameters({n: p.grad for n, p in model.named_parameters()}, expected, rtol=1e-5)


def test_the_plan_says_the_micro_batch_is_cut_by_the_token_budget(make_trainer, varied, caplog):
    trainer = make_trainer(
        [AdaptiveBatch(max_tokens_per_micro_batch=4096, micro_batch_size=4)],
        dataset=varied,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        max_steps=1,
    )
    with caplog.at_level("INFO", logger="adaptive_batch"):
        trainer.train()
    table = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("AdaptiveBatch plan"))
    micro = next(line for line in table.splitlines() if line.strip().startswith("micro-batch "))
    assert micro.split(maxsplit=1)[1] == (
        "cut by a token budget of 4,096 padded tokens (rows x padded length), at most 4 rows; the budget halves "
        "and the step retries on out-of-memory"
    )
    assert "accumulation               as many as the rows' lengths need (the user's: 1)" in table


def test_a_row_longer_than_the_budget_is_warned_about_once(make_trainer, varied, caplog):
    with caplog.at_level("WARNING", logger="adaptive_batch"):
        trainer = train(make_trainer, varied, [AdaptiveBatch(max_tokens_per_micro_batch=20)])
    warnings = [
        r.getMessage() for r in caplog.records if "longer than max_tokens_per_micro_batch" in r.getMessage()
    ]
    assert len(warnings) == 1
    longest = max(len(row["input_ids"]) for row in varied)  # read from the dataset before training
    assert warnings[0].startswith(f"A row of {longest} tokens is longer than max_tokens_per_micro_batch=20")
    assert "Raise max_tokens_per_micro_batch" in warnings[0] and "lower max_length" in warnings[0]
    assert all(rows == 1 or rows * length <= 20 for _, rows, length, *_ in trainer.micro_batches)
    assert any(rows == 1 and length > 20 for _, rows, length, *_ in trainer.micro_batches)


def test_a_dataset_row_longer_than_the_budget_is_warned_about_before_training(make_trainer, varied, caplog):
    from datasets import Dataset

    forwards = []
    trainer = make_trainer(
        [AdaptiveBatch(max_tokens_per_micro_batch=20)],
        dataset=Dataset.from_list(varied),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
    )
    trainer.model.register_forward_hook(lambda *args: forwards.append(len(caplog.records)))
    with caplog.at_level("WARNING", logger="adaptive_batch"):
        trainer.train()
    warned = [
        i for i, r in enumerate(caplog.records) if "longer than max_tokens_per_micro_batch" in r.getMessage()
    ]
    assert len(warned) == 1 and warned[0] < forwards[0]  # before the first forward
    assert caplog.records[warned[0]].getMessage().startswith("A row of 32 tokens")


# -- out of memory ---------------------------------------------------------------------------------------------------


def test_out_of_memory_halves_the_budget_and_the_result_is_unchanged(make_trainer, varied):
    # an overhead of 16 tokens cuts the first step's 28, 25, 20, 17, 14, 9, 6 and 3 tokens into 2, 3 and 3 rows
    callback = AdaptiveBatch(max_tokens_per_micro_batch=128, micro_batch_overhead=16, padding_free=False)
    trainer = make_trainer([callback], dataset=varied, **SETTINGS)
    first_step = StepBatch(first_step_batch(trainer))
    sizes = first_step.token_chunks(128, 8, 16)
    tokens = padded_tokens(first_step, sizes)
    fits = tokens[0]  # the first micro-batch of the first step fits, the second (more tokens) does not
    failing = next(i for i, count in enumerate(tokens) if count > fits)
    assert failing == 1
    watcher = FakeOutOfMemory(trainer.model, max_rows=None, max_tokens=fits)
    trainer.train()

    assert watcher.tokens[: failing + 1] == tokens[: failing + 1]
    # the step runs again at half of what failed (128 never ran a step, so it is not tried again), and from then
    # on every micro-batch holds at most the halved budget
    assert watcher.raised == [sizes[failing]]
    halved = adaptive_of(trainer).current()["max_tokens_per_micro_batch"]
    assert halved <= tokens[failing] // 2 <= 64
    last_failure = max(
        i for i, (rows, count) in enumerate(zip(watcher.sizes, watcher.tokens)) if count > fits
    )
    after = zip(watcher.sizes[last_failure + 1 :], watcher.tokens[last_failure + 1 :])
    assert all(rows == 1 or count <= halved for rows, count in after)
    assert step_logs(trainer)[-1]["adaptive_batch/samples_seen"] == 2 * len(varied)  # the budget exact
    plain = train(make_trainer, varied)
    assert_close_parameters(parameters(trainer.model), parameters(plain.model))


def test_the_halved_budget_survives_a_resume(make_trainer, varied, tmp_path):
    def run(output_dir, fake_oom, resume=None):
        trainer = make_trainer(
            [AdaptiveBatch(max_tokens_per_micro_batch=128)],
            dataset=varied,
            per_device_train_batch_size=8,
            gradient_accumulation_steps=1,
            num_train_epochs=2,
            dtype=torch.float64,
            save_strategy="steps",
            save_steps=3,
            output_dir=str(output_dir),
        )
        if fake_oom:
            FakeOutOfMemory(trainer.model, max_rows=None, max_tokens=70)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full", fake_oom=True)
    halved = adaptive_of(full).current()["max_tokens_per_micro_batch"]
    assert halved < 70
    resumed = run(tmp_path / "resumed", fake_oom=False, resume=str(tmp_path / "full" / "checkpoint-6"))
    assert adaptive_of(resumed).current()["max_tokens_per_micro_batch"] == halved
    assert_same_parameters(full.model, resumed.model)


def test_one_row_out_of_memory_is_one_clear_error(make_trainer, varied):
    trainer = make_trainer(
        [AdaptiveBatch(max_tokens_per_micro_batch=BUDGET)],
        dataset=varied,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
    )
    FakeOutOfMemory(trainer.model, max_rows=None, max_tokens=2)
    with pytest.raises(MicroBatchTooLargeError, match="One sample per micro-batch") as error:
        trainer.train()
    assert error.value.tried[-1] == 1 and all(rows > 1 for rows in error.value.tried[:-1])
    assert trainer.state.global_step == 0


# -- "auto" on rows of varying length ----------------------------------------------------------------------------------


def test_auto_on_rows_of_varying_length_cuts_by_tokens_at_the_least_measured_time(
    make_trainer, varied, caplog
):
    with caplog.at_level("INFO", logger="adaptive_batch"):
        trainer = train(make_trainer, varied, [AdaptiveBatch()])
    table = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("AdaptiveBatch plan"))
    assert "auto, rows of varying length: cut by padded tokens" in table
    assert "the budget starts at 256" in table  # the per-device 8 rows x the longest row, 32 tokens
    now = adaptive_of(trainer).current()
    # the overhead measured (or none fitted: one longest row), the budget set
    assert now["cut_by"] == "tokens" and now["micro_batch_settled_because"] is not None
    assert (
        len(saved_state(trainer)["micro_batch"]["time_points"]) >= 2
    )  # the calibration steps' micro-batches
    settled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("AdaptiveBatch settled")]
    assert settled == [f"AdaptiveBatch settled: {now['micro_batch_settled_because']}."]
    per_step = [[rows for step, rows, *_ in trainer.micro_batches if step == k] for k in range(12)]
    assert [sum(rows) for rows in per_step] == [8] * 12  # every sample once, the effective batch exact
    assert_close_parameters(parameters(trainer.model), parameters(train(make_trainer, varied).model))


def test_auto_on_rows_of_one_length_measures_rows(make_trainer, fixed_rows):
    trainer = make_trainer([AdaptiveBatch()], dataset=fixed_rows[:16], max_steps=1)
    trainer.train()
    assert adaptive_of(trainer).current()["cut_by"] == "rows"


def test_auto_by_tokens_resumes_bitwise_once_its_measurements_are_done(make_trainer, varied, tmp_path):
    def run(output_dir, resume=None):
        trainer = make_trainer(
            [AdaptiveBatch(padding_free=False)],
            **{**SETTINGS, "dataset": varied, "save_strategy": "steps", "save_steps": 1},
            output_dir=str(output_dir),
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full")
    states = {
        k: json.loads((tmp_path / "full" / f"checkpoint-{k}" / "trainer_state.json").read_text())
        for k in range(1, 12)
    }
    controllers = {
        k: state["stateful_callbacks"]["AdaptiveBatch"]["attributes"]["checkpoint"]["micro_batch"]
        for k, state in states.items()
    }
    measured = [k for k, c in controllers.items() if not c["calibrating"] and not c["tuning"]]
    first = min(measured)
    assert first >= CALIBRATION_STEPS + 1  # a warm-up step, the timed ones, and the budget's growth
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "full" / f"checkpoint-{first}"))
    assert (
        step_logs(resumed)[-1]["adaptive_batch/tokens_seen"]
        == step_logs(full)[-1]["adaptive_batch/tokens_seen"]
    )
    cuts = [(log["step"], log["adaptive_batch/accumulation_steps"]) for log in step_logs(full)]
    assert [(log["step"], log["adaptive_batch/accumulation_steps"]) for log in step_logs(resumed)] == cuts
    assert_same_parameters(full.model, resumed.model)


def test_a_checkpoint_cut_by_rows_is_not_taken_as_a_token_budget(
    make_trainer, varied, fixed_rows, tmp_path, caplog
):
    def run(dataset, output_dir, resume=None):
        trainer = make_trainer(
            [AdaptiveBatch(padding_free=False)],
            **{**SETTINGS, "dataset": dataset, "save_strategy": "steps", "save_steps": 2},
            output_dir=str(output_dir),
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    run(fixed_rows[: len(varied)], tmp_path / "rows")  # "auto" on rows of one length: cut by rows
    with caplog.at_level("INFO", logger="adaptive_batch"):
        resumed = run(varied, tmp_path / "tokens", resume=str(tmp_path / "rows" / "checkpoint-2"))
    assert (
        "cut by tokens now; the checkpoint's run cut by rows, and what it learned is not used" in caplog.text
    )
    assert adaptive_of(resumed).current()["cut_by"] == "tokens"


class TokenisedOnAccess(torch.utils.data.Dataset):
    """The same rows behind `__getitem__`, as a custom dataset that tokenises there: nothing to read before
    training."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return {"input_ids": list(self.rows[index]["input_ids"])}


def transformed(rows):
    """A `datasets.Dataset` whose rows are made by `set_transform`: its table holds no `input_ids` to count."""
    from datasets import Dataset

    dataset = Dataset.from_dict({"row": list(range(len(rows)))})
    dataset.set_transform(lambda batch: {"input_ids": [rows[i]["input_ids"] for i in batch["row"]]})
    return dataset


@pytest.mark.parametrize("wrap", [TokenisedOnAccess, transformed], ids=["torch Dataset", "set_transform"])
def test_a_dataset_that_cannot_tell_its_lengths_is_cut_by_tokens_from_its_first_step(
    make_trainer, varied, wrap, caplog
):
    stated = dict(micro_batch_overhead=10)  # the cut then depends on the rows' lengths alone
    listed = train(make_trainer, varied, [AdaptiveBatch(**stated)])
    with caplog.at_level("INFO", logger="adaptive_batch"):
        wrapped = train(make_trainer, wrap(varied), [AdaptiveBatch(**stated)], remove_unused_columns=False)
    assert adaptive_of(wrapped).current()["cut_by"] == "tokens"
    assert "the first step's rows vary in length" in caplog.text
    assert (
        "the dataset cannot tell its rows' lengths before training" in caplog.text
    )  # the plan table says so
    padded = [sum(rows * length for _, rows, length, *_ in run.micro_batches) for run in (listed, wrapped)]
    assert padded[1] == padded[0]  # the same cut as the list's, not every step padded to its longest row
    assert [m[4] for m in wrapped.micro_batches] == [m[4] for m in listed.micro_batches]


def test_a_resumed_run_over_a_dataset_that_cannot_tell_its_lengths_cuts_as_the_uninterrupted_one(
    make_trainer, varied, tmp_path
):
    def run(output_dir, resume=None):
        trainer = make_trainer(
            [AdaptiveBatch(micro_batch_overhead=10)],
            **{**SETTINGS, "dataset": TokenisedOnAccess(varied), "trainer_class": Recording},
            remove_unused_columns=False,
            save_strategy="steps",
            save_steps=3,
            output_dir=str(output_dir),
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full")
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-3"))
    assert adaptive_of(resumed).current()["cut_by"] == "tokens"
    later = [m[:3] for m in full.micro_batches if m[0] >= 3]
    assert [m[:3] for m in resumed.micro_batches] == later
    assert_same_parameters(resumed.model, full.model)
