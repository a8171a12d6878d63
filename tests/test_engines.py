"""What each engine decides before any compute: whether an out-of-memory error can be retried (and why not), and
the DeepSpeed config AdaptiveBatch needs or refuses. Training under each engine: test_ddp.py, test_deepspeed.py."""

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from adaptive_batch import compat
from adaptive_batch.engines import FullyShardedV2, prepare


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


def test_under_deepspeed_the_step_owns_the_accumulation_boundary():
    config = {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": "auto"}
    prepare(deepspeed_trainer(config))
    assert config[compat.MANAGED_ACCUMULATION] is False


def test_a_deepspeed_scheduler_is_refused_with_the_fix():
    config = {"scheduler": {"type": "WarmupDecayLR", "params": {}}}
    with pytest.raises(ValueError, match="scheduler \\('WarmupDecayLR'\\).*set lr_scheduler_type"):
        prepare(deepspeed_trainer(config))
    assert compat.MANAGED_ACCUMULATION not in config  # refused before anything was changed


@pytest.mark.parametrize("retries", [True, False])
def test_a_controller_under_an_engine_that_cannot_retry_grows_only_where_memory_bounds_it(
    make_trainer, monkeypatch, retries
):
    from adaptive_batch import AdaptiveBatch, engines, session

    class NoRetry(engines.Engine):
        pass

    NoRetry.retries = retries
    monkeypatch.setattr(session, "engine_for", lambda trainer, world_size: NoRetry())
    adaptive = AdaptiveBatch()
    trainer = make_trainer(callbacks=[adaptive])
    assert trainer._adaptive_batch.controller.oom_is_fatal is not retries
    tokens = make_trainer(callbacks=[AdaptiveBatch(max_tokens_per_micro_batch=64)])
    assert tokens._adaptive_batch.controller.oom_is_fatal is not retries
