"""Every `TrainerState` field as the plain Trainer has it, at every callback event of a run at a constant batch
(micro-batch 1 and the whole step): 3 epochs with an epoch's short last step, epoch-strategy evaluation, saving and
the best model, input tokens counted ("all" and "non_padding", on rows the plain Trainer pads to different widths).
Floats computed from the losses (a different order of additions, summed in float32 by the Trainer) are compared within
`LOSS_TOLERANCE`; everything else is equal. What AdaptiveBatch adds to the logs (its
`adaptive_batch/*` keys) is left out: README, "What it logs"."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import ORDER_ONLY
from transformers import TrainerCallback, TrainerState

from adaptive_batch import AdaptiveBatch

FIELDS = [field.name for field in dataclasses.fields(TrainerState)]
FROM_LOSSES = ("best_metric", "loss", "grad_norm")  # (the order of additions; eval_loss and train_loss too)
LOSS_TOLERANCE = 1e-6  # (float32's rounding of the logged loss: the Trainer's running sum is float32)
TIMINGS = ("runtime", "per_second")


def comparable(value):
    """A state value, its timings and AdaptiveBatch's own log keys left out."""
    if isinstance(value, dict):
        return {
            k: comparable(v)
            for k, v in value.items()
            if "adaptive_batch/" not in k and not any(t in k for t in TIMINGS)
        }
    if isinstance(value, list):
        return [comparable(v) for v in value]
    return value


def same(ours, plain, key: str = "") -> bool:
    """Equal, but the floats that come from losses (the Trainer sums them in float32), within `LOSS_TOLERANCE`."""
    if isinstance(plain, dict):
        return (
            isinstance(ours, dict)
            and ours.keys() == plain.keys()
            and all(same(ours[k], plain[k], k) for k in plain)
        )
    if isinstance(plain, list):
        return (
            isinstance(ours, list)
            and len(ours) == len(plain)
            and all(map(same, ours, plain, [key] * len(plain)))
        )
    if isinstance(plain, float) and key.endswith(FROM_LOSSES):
        return ours == pytest.approx(plain, rel=LOSS_TOLERANCE)
    return ours == plain


class StateLog(TrainerCallback):
    """The whole state at every event: (event, {field: value}), the run's output_dir written as "OUT"."""

    def __init__(self, output_dir: str):
        self.states: list[tuple[str, dict]] = []
        self.output_dir = output_dir

    def __getattribute__(self, name):
        if name.startswith("on_") and name not in ("on_init_end", "on_push_begin"):
            states = object.__getattribute__(self, "states")

            def record(args, state, control, **kwargs):
                snapshot = {f: comparable(getattr(state, f)) for f in FIELDS if f != "stateful_callbacks"}
                snapshot["log_history"] = comparable(state.log_history)
                output_dir = object.__getattribute__(self, "output_dir")
                if snapshot["best_model_checkpoint"]:
                    snapshot["best_model_checkpoint"] = snapshot["best_model_checkpoint"].replace(
                        output_dir, "OUT"
                    )
                states.append((name, snapshot))

            return record
        return object.__getattribute__(self, name)


@pytest.mark.parametrize(
    "tokens, num_rows",
    [
        ("all", 36),
        ("non_padding", 38),
    ],  # 5 steps of 8 an epoch, the last of 4; the last of 6 (batches of 4 and 2)
)
@pytest.mark.parametrize("micro_batch_size", [1, 8])
def test_every_state_field_at_every_event_is_the_plain_trainers(
    make_trainer, rows, tmp_path, micro_batch_size, tokens, num_rows
):
    # rows of 4 to 31 tokens, so that the plain Trainer's batches of 4 are padded to different widths
    ragged = [
        {"input_ids": row["input_ids"][: 4 + index * 7 % 28]} for index, row in enumerate(rows[:num_rows])
    ]

    def run(name, callbacks):
        output_dir = str(tmp_path / name)
        log = StateLog(output_dir)
        trainer = make_trainer(
            [*callbacks, log],
            dataset=ragged,
            num_train_epochs=3,
            eval_strategy="epoch",
            save_strategy="epoch",
            load_best_model_at_end=True,
            include_num_input_tokens_seen=tokens,
            eval_dataset=rows[100:108],
            output_dir=output_dir,
            **ORDER_ONLY,
        )
        trainer.train()
        saved = {
            key: value for key, value in trainer.state.stateful_callbacks.items() if key != "AdaptiveBatch"
        }
        return log.states, saved

    plain, plain_saved = run("plain", [])
    ours, ours_saved = run("adaptive", [AdaptiveBatch(micro_batch_size=micro_batch_size)])
    assert [event for event, _ in ours] == [event for event, _ in plain]
    for (event, state), (_, expected) in zip(ours, plain):
        differing = [field for field in expected if not same(state[field], expected[field], field)]
        assert not differing, (event, state["global_step"], {f: (state[f], expected[f]) for f in differing})
    assert ours_saved == plain_saved  # (the Trainer's own stateful callbacks: TrainerControl's flags)


def test_flops_are_the_plain_trainers_with_one_walk_over_the_parameters(make_trainer, rows, tmp_path):
    def run(name, callbacks):
        trainer = make_trainer(
            callbacks,
            num_rows=32,
            per_device_train_batch_size=1,
            gradient_accumulation_steps=8,  # (8 loop batches a step, however AdaptiveBatch cuts it)
            output_dir=str(tmp_path / name),
        )
        walks = []
        counted = trainer.model.num_parameters
        trainer.model.num_parameters = lambda *args, **kwargs: walks.append(1) or counted(*args, **kwargs)
        trainer.train()
        return trainer.state.total_flos, len(walks)

    plain_flops, plain_walks = run("plain", [])
    flops, walks = run("adaptive", [AdaptiveBatch(micro_batch_size=8)])
    assert flops == plain_flops
    assert plain_walks >= 32 and walks <= 2  # (the plain Trainer walks them for each of its 32 batches)


def test_floating_point_ops_outside_train_is_the_plain_trainers(make_trainer):
    inputs = {"input_ids": torch.ones(2, 5, dtype=torch.long)}
    plain = make_trainer([]).floating_point_ops(inputs)
    assert make_trainer([AdaptiveBatch()]).floating_point_ops(inputs) == plain > 0
