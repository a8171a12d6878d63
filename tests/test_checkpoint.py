"""The resume rules of `checkpoint.py`, as pure functions: what changed in a plan, and which micro-batch settings
apply."""

from adaptive_batch.core.checkpoint import MicroBatchSettings, PlanIdentity, learned_state_applies
from adaptive_batch.core.rows import RowController

IDENTITY = PlanIdentity(
    dataset_size=44,
    budget_samples=88,
    drop_last=False,
    data_seed=0,
    shuffle=True,
    adopted_at_step=0,
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
    assert IDENTITY.differences({"fingerprint": "a"}) == []  # an older checkpoint holds the fingerprint alone


def test_learned_state_applies_only_under_the_settings_it_was_learned_with():
    auto = MicroBatchSettings("auto", None, None)
    fixed = MicroBatchSettings(8, None, None)
    stored_auto, stored_fixed = vars(auto), vars(fixed)
    assert learned_state_applies(stored_fixed, fixed)[0]  # an out-of-memory shrink under the same settings
    assert learned_state_applies(stored_auto, MicroBatchSettings("auto", 16, None))[0]  # capped now
    assert not learned_state_applies(stored_fixed, MicroBatchSettings(2, None, None))[0]
    assert not learned_state_applies(stored_fixed, MicroBatchSettings("auto", 2, None))[0]
    assert not learned_state_applies(stored_auto, MicroBatchSettings("auto", None, 4096))[0]  # now by tokens
    applies, message = learned_state_applies(stored_fixed, MicroBatchSettings(2, None, None))
    assert message == (
        "Micro-batches: micro_batch_size=2 as set now; the checkpoint's run had micro_batch_size=8, and what it "
        "learned under those settings is not used."
    )
    assert learned_state_applies(None, auto)[0]  # a checkpoint from before settings were stored


def test_a_cap_stated_after_the_size_was_learned_holds_from_then_on():
    controller = RowController(start=4, auto=True, row_limit=64)
    controller.record(4, 1.0, 400)
    controller.record(4, 1.0, 400)  # 4 kept: the trial moves on to 8
    assert controller.exploring and controller.trial == 8
    controller.limit_to(6)
    assert controller.size == 4 and not controller.exploring and controller.next_size(64) <= 6
    controller.limit_to(2)
    assert controller.size == 2
