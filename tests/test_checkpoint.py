"""The resume rules of `checkpoint.py`, as pure functions: what changed in a plan, and which micro-batch settings
apply."""

import pytest

from adaptive_batch.core.checkpoint import SCHEMA_VERSION, PlanIdentity, check_schema, learned_state_applies
from adaptive_batch.core.config import AdaptiveBatchConfig
from adaptive_batch.core.rows import RowController

IDENTITY = PlanIdentity(
    dataset_size=44,
    budget_samples=88,
    drop_last=False,
    data_seed=0,
    shuffle=True,
    adopted_at_step=0,
    schedule="8 -> 32 (phases start at 0.5 fraction)",
    lr_scaling="linear",
    fingerprint="a",
)


def test_every_changed_field_is_named_and_the_cut_only_when_nothing_else_explains_it():
    stored = dict(vars(IDENTITY))
    assert IDENTITY.differences(stored) == []
    assert IDENTITY.differences({**stored, "data_seed": 3, "shuffle": False, "fingerprint": "b"}) == [
        "data seed (data_seed, or seed when data_seed is not set): 3 in the checkpoint, 0 now",
        "shuffled epochs (train_sampling_strategy): False in the checkpoint, True now",
    ]
    assert IDENTITY.differences({**stored, "fingerprint": "b"}) == [
        "the cut into steps (the schedule gives other effective batches, or the budget counts differently)"
    ]


def test_another_schedule_or_lr_rule_is_named_with_both_values_and_explains_the_cut():
    stored = dict(vars(IDENTITY))
    changed = {
        **stored,
        "schedule": "8 -> 16 (phases start at 0.5 fraction)",
        "lr_scaling": "sqrt",
        "fingerprint": "b",
    }
    assert IDENTITY.differences(changed) == [
        "schedule: '8 -> 16 (phases start at 0.5 fraction)' in the checkpoint, "
        "'8 -> 32 (phases start at 0.5 fraction)' now",
        "lr_scaling: 'sqrt' in the checkpoint, 'linear' now",
    ]


def settings(micro_batch_size="auto", max_micro_batch_size=None, max_tokens_per_micro_batch=None) -> dict:
    """The micro-batch settings a checkpoint records, as `AdaptiveBatch(...)` with these would record them."""
    return AdaptiveBatchConfig(
        micro_batch_size=micro_batch_size,
        max_micro_batch_size=max_micro_batch_size,
        max_tokens_per_micro_batch=max_tokens_per_micro_batch,
    ).micro_batch_settings()


def test_the_micro_batch_settings_a_checkpoint_records_are_those_that_decide_the_cut():
    assert sorted(settings()) == [
        "max_micro_batch_size",
        "max_tokens_per_micro_batch",
        "micro_batch_overhead",
        "micro_batch_size",
        "padding_free",
    ]


def test_learned_state_applies_only_under_the_settings_it_was_learned_with():
    stored_auto, stored_fixed = settings("auto"), settings(8)
    assert learned_state_applies(stored_fixed, settings(8))[
        0
    ]  # an out-of-memory shrink under the same settings
    assert learned_state_applies(stored_auto, settings("auto", 16))[0]  # capped now
    assert not learned_state_applies(stored_fixed, settings(2))[0]
    assert not learned_state_applies(stored_fixed, settings("auto", 2))[0]
    assert not learned_state_applies(stored_auto, settings("auto", None, 4096))[0]  # now by tokens
    applies, message = learned_state_applies(stored_fixed, settings(2))
    assert message == (
        "Micro-batches: micro_batch_size=2 as set now; the checkpoint's run had micro_batch_size=8, and what it "
        "learned under those settings is not used."
    )


def test_a_checkpoint_of_another_layout_is_refused_by_name():
    check_schema({"schema": SCHEMA_VERSION}, "out/checkpoint-4")
    with pytest.raises(ValueError) as error:
        check_schema({"plan_fingerprint": "abc"}, "out/checkpoint-4")
    assert str(error.value) == (
        f"out/checkpoint-4 holds AdaptiveBatch state of layout None, and this release of adaptive-batch reads layout "
        f"{SCHEMA_VERSION}. Resume it with the release that wrote it, or start a new run."
    )


def test_a_cap_stated_after_the_size_was_learned_holds_from_then_on():
    controller = RowController(start=4, auto=True, row_limit=64)
    controller.record(4, 1.0, 400)
    controller.record(4, 1.0, 400)  # 4 kept: the trial moves on to 8
    assert controller.exploring and controller.trial == 8
    controller.limit_to(6)
    assert controller.size == 4 and not controller.exploring and controller.next_size(64) <= 6
    controller.limit_to(2)
    assert controller.size == 2


def test_the_readme_names_every_field_a_resume_must_keep():
    """README's "Interrupt and resume" lists what must stay the same: every field of the plan's identity that a user
    sets (a field added to `PlanIdentity` fails here until the README names it)."""
    from dataclasses import fields
    from pathlib import Path

    readme = Path(__file__).resolve().parents[1].joinpath("README.md").read_text()
    section = readme.split("## Interrupt and resume", 1)[1].split("\n## ", 1)[0]
    must_stay = section.split("**What must stay the same**", 1)[1].split("\n- **", 1)[0]
    named = {  # the README's words for each field
        "dataset_size": "the dataset's size",
        "budget_samples": "the budget",
        "drop_last": "`dataloader_drop_last`",
        "data_seed": "`data_seed`",
        "shuffle": "the shuffle setting",
        "schedule": "the schedule",
        "lr_scaling": "`lr_scaling`",
    }
    internal = {"adopted_at_step", "fingerprint"}  # not a setting: taken from the checkpoint, or derived
    assert set(named) == {f.name for f in fields(PlanIdentity)} - internal
    for field, words in named.items():
        assert words in " ".join(must_stay.split()), (field, words)
