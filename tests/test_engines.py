"""What each engine decides before any compute: whether an out-of-memory error can be retried (and why not), and
the DeepSpeed config AdaptiveBatch needs or refuses. Training under each engine: test_ddp.py, test_deepspeed.py."""

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from adaptive_batch.runtime.compat import deepspeed as compat
from adaptive_batch.runtime.engines import FullyShardedV2, prepare


def test_fsdp2_retries_in_one_process_only():
    assert FullyShardedV2(world_size=1).retries
    several = FullyShardedV2(world_size=2)
    assert not several.retries
    message = str(several.out_of_memory(torch.OutOfMemoryError("CUDA out of memory"), 2))
    assert "under FSDP2 with 2 processes: its forward and backward passes hold collectives" in message
    assert "adaptive-batch probe" in message and message.endswith("The error was: CUDA out of memory")


def test_fsdp2_on_a_torch_that_cannot_undo_a_pass_does_not_retry_and_says_why(monkeypatch):
    # torch 2.11 (the GPU machine's) has no FSDPModule.reset_iter_state
    monkeypatch.delattr(FSDPModule, "reset_iter_state")
    engine = FullyShardedV2(world_size=1)
    assert not engine.retries
    message = str(engine.out_of_memory(torch.OutOfMemoryError("CUDA out of memory"), 1))
    assert f"torch {torch.__version__} has no FSDPModule.reset_iter_state" in message


def deepspeed_trainer(config: dict):
    plugin = SimpleNamespace(deepspeed_config=config)
    return SimpleNamespace(
        is_deepspeed_enabled=True, accelerator=SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin))
    )


def test_under_deepspeed_a_config_that_took_the_boundary_from_deepspeed_gives_it_back(caplog):
    # AdaptiveBatch marks each step's last micro-batch as the boundary, which DeepSpeed allows only when it manages
    # the accumulation (the default)
    default = {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": "auto"}
    prepare(deepspeed_trainer(default))
    assert compat.MANAGED_ACCUMULATION not in default
    taken = {"zero_optimization": {"stage": 2}, compat.MANAGED_ACCUMULATION: False}
    with caplog.at_level("WARNING", logger="adaptive_batch"):
        prepare(deepspeed_trainer(taken))
    assert taken[compat.MANAGED_ACCUMULATION] is True
    assert f"{compat.MANAGED_ACCUMULATION}: false in the config is set to true" in caplog.text


def test_a_deepspeed_scheduler_is_refused_with_the_fix():
    config = {"scheduler": {"type": "WarmupDecayLR", "params": {}}}
    with pytest.raises(ValueError, match="scheduler \\('WarmupDecayLR'\\).*set lr_scheduler_type"):
        prepare(deepspeed_trainer(config))
    assert compat.MANAGED_ACCUMULATION not in config  # refused before anything was changed


@pytest.mark.parametrize("retries", [True, False])
def test_a_controller_under_an_engine_that_cannot_retry_grows_only_where_memory_bounds_it(
    make_trainer, monkeypatch, retries
):
    # the plan table says what an out-of-memory error does; the growth it implies is tested in
    # test_microbatch.py and test_cut.py (`oom_is_fatal`)
    from adaptive_batch import AdaptiveBatch
    from adaptive_batch.hf import assemble
    from adaptive_batch.runtime import engines

    class NoRetry(engines.SingleProcess):
        pass

    NoRetry.retries = retries
    monkeypatch.setattr(assemble, "engine_for", lambda trainer, world_size: NoRetry())
    for settings in ({}, {"max_tokens_per_micro_batch": 64}):
        adaptive = AdaptiveBatch(**settings)
        make_trainer(callbacks=[adaptive])
        text = dict(adaptive.plan_table())["micro-batch"]
        fatal = "an out-of-memory error cannot be retried under this engine and world size"
        assert (fatal in text) is not retries, text
        assert text.endswith("on out-of-memory") is retries, text


class Boundaries:
    """Records what the engine is told: per attempt at a step, each micro-batch's `last`, then "step" (finished) or
    "failed" (forgotten)."""

    def __init__(self, engine):
        self.engine, self.attempts = engine, [[]]

    def micro_batch(self, model, last):
        self.attempts[-1].append(last)
        return self.engine.micro_batch(model, last)

    def finish_step(self, model):
        self.attempts[-1].append("step")
        self.attempts.append([])
        self.engine.finish_step(model)

    def forget(self, model, optimizer):
        self.attempts[-1].append("failed")
        self.attempts.append([])
        self.engine.forget(model, optimizer)

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.mark.parametrize("cut", ["rows", "tokens"])
def test_each_steps_last_micro_batch_and_only_it_is_the_boundary(make_trainer, fixed_rows, monkeypatch, cut):
    # DeepSpeed does the boundary's work in the backward of the micro-batch told `last` (test_deepspeed.py trains
    # through it): under both cuts, and after out-of-memory errors (the first in a step's last micro-batch), every
    # finished attempt ends with the one micro-batch told `last`
    from adaptive_batch import AdaptiveBatch
    from adaptive_batch.hf import assemble
    from adaptive_batch.runtime import engines
    from adaptive_batch.testing import FakeOutOfMemory

    recorded = []
    monkeypatch.setattr(
        assemble,
        "engine_for",
        lambda trainer, world_size: recorded.append(Boundaries(engines.SingleProcess())) or recorded[-1],
    )
    dataset = fixed_rows[:96] if cut == "rows" else None  # rows of 3 to 32 tokens: cut by tokens
    trainer = make_trainer(
        callbacks=[AdaptiveBatch()], dataset=dataset, num_rows=96, per_device_train_batch_size=16
    )
    limits = dict(max_rows=4) if cut == "rows" else dict(max_rows=None, max_tokens=96)
    watcher = FakeOutOfMemory(trainer.model, **limits, only_after_calls=1)
    trainer.train()
    attempts = [attempt for attempt in recorded[-1].attempts if attempt]
    assert watcher.raised and [attempt[-1] for attempt in attempts].count("failed") == len(watcher.raised)
    assert [attempt[-1] for attempt in attempts].count("step") == trainer.state.global_step
    assert attempts[0] == [False, True, "failed"]  # the first micro-batch passed, the step's last failed
    assert any(len(attempt) > 3 for attempt in attempts)  # several micro-batches in a step
    for attempt in attempts:
        *told, end = attempt
        assert not any(told[:-1]), attempt
        if end == "step":
            assert told[-1] is True, attempt
