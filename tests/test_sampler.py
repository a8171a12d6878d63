from collections import Counter

import pytest

from adaptive_batch.core.schedule import PhaseSchedule
from adaptive_batch.core.steps import Budget, build_plan
from adaptive_batch.runtime.sampler import StepBatchSampler


def plan_for(world_size, dataset_size=47, epochs=3, drop_last=False):
    schedule = PhaseSchedule([2 * world_size, 5 * world_size], boundaries=[0.4])
    return build_plan(schedule, dataset_size, Budget.from_epochs(epochs, dataset_size), world_size, drop_last)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_each_sample_once_per_epoch_across_all_ranks(world_size):
    plan = plan_for(world_size)
    samplers = [StepBatchSampler(plan, seed=7, rank=r) for r in range(world_size)]
    per_epoch = [Counter() for _ in range(plan.num_epochs)]
    for step, shares in enumerate(zip(*samplers)):
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
        assert sum(map(len, shares)) == plan.sizes[step]
        for share in shares:
            per_epoch[plan.epoch(step)].update(share)
    for counter in per_epoch:
        assert counter == Counter(range(47))


def test_drop_last_never_repeats_a_sample_within_an_epoch():
    plan = plan_for(2, drop_last=True)
    sampler = [StepBatchSampler(plan, seed=7, rank=r) for r in range(2)]
    seen = Counter()
    for step, shares in enumerate(zip(*sampler)):
        seen.update((plan.epoch(step), i) for share in shares for i in share)
    assert max(seen.values()) == 1


def test_epochs_are_different_permutations_and_the_order_is_reproducible():
    plan = plan_for(1)
    a, b = list(StepBatchSampler(plan, seed=3)), list(StepBatchSampler(plan, seed=3))
    assert a == b
    epoch_orders = [[i for k, s in enumerate(a) if plan.epoch(k) == e for i in s] for e in range(3)]
    assert epoch_orders[0] != epoch_orders[1] != epoch_orders[2]
    assert list(StepBatchSampler(plan, seed=4)) != a


def test_sequential_order_and_starting_at_a_step():
    plan = plan_for(1)
    sequential = list(StepBatchSampler(plan, seed=0, shuffle=False))
    assert sequential[0] == [0, 1] and sequential[1] == [2, 3]
    resumed = list(StepBatchSampler(plan, seed=0, shuffle=False, start_step=5))
    assert resumed == sequential[5:] and len(StepBatchSampler(plan, seed=0, start_step=5)) == len(resumed)


def test_rank_outside_the_world_is_rejected():
    with pytest.raises(ValueError, match="rank=2 is outside world_size=2"):
        StepBatchSampler(plan_for(2), seed=0, rank=2)
