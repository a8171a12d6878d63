"""DeepSpeed ZeRO-1, 2 and 3, and ZeRO-2 with the optimizer offloaded to the CPU, on CPU processes (gloo; tests/ddp_worker.py's `zero1`..`zero3` kinds): every sample once,
the global batch exact, the parameters those of one process without DeepSpeed taking each step in one micro-batch, an
out-of-memory error in the middle of a step's last backward (DeepSpeed's accumulation boundary) retried bit for bit
in one process, one ending every rank with the error in two, and a resume from DeepSpeed's checkpoint bit for bit.

ZeRO keeps float32 master weights, so the float64 model of the worker is rounded to float32 at every step: runs are
compared within DEEPSPEED_TOLERANCE, not helpers.py's ORDER_TOLERANCE (DeepSpeed against the run without it: 1.3e-7).
ZeRO-3 refuses float64 parameters on any device (its `zero.Init` asserts half, bfloat16 or float32), so its worker
runs in float32, as on a GPU, and so does ZeRO-2 offloaded; each float32 run is compared with the run without
DeepSpeed in float32 (7.1e-8 at most there), never with the float64 one.
"""

import json

import pytest
from launch import assert_same_weights, launch

# under `pytest -n 2 --dist loadgroup`, one worker runs the tests that launch several processes, one after another
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("launch")]
DEEPSPEED_TOLERANCE = 1e-6
COUNTS = ("adaptive_batch/effective_batch_size", "adaptive_batch/samples_seen", "adaptive_batch/tokens_seen")


# ZeRO-3's worker: DeepSpeed's zero.Init takes the dtype of the model's first parameter and asserts it is half,
# bfloat16 or float32 ("Invalid data type torch.float64"), on the CPU as on a GPU
FLOAT32 = {"WORKER_DTYPE": "float32"}
# ZeRO-2 with the optimizer offloaded to the CPU (the classic recipe); `zero_force_ds_cpu_optimizer: false` keeps the
# worker's SGD (else accelerate swaps in DeepSpeed's CPU Adam, which the runs without DeepSpeed do not have)
OFFLOAD = {
    "WORKER_DEEPSPEED": json.dumps(
        {
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            "zero_force_ds_cpu_optimizer": False,
        }
    ),
    # float32 weights, as ZeRO's: gradients accumulate in the CPU buffers as on a GPU in bf16 (float64 weights take
    # DeepSpeed's other path, a float32 partition on the device)
    **FLOAT32,
}
STAGES = pytest.mark.parametrize(
    "stage, env", [(1, None), (2, None), (3, FLOAT32), (2, OFFLOAD)], ids=["1", "2", "3", "2-offload"]
)


def same_dtype(env):
    """The environment of the reference run without DeepSpeed: the dtype of the run it is compared with."""
    return {"WORKER_DTYPE": env["WORKER_DTYPE"]} if env and "WORKER_DTYPE" in env else None


def assert_close(a, b, tolerance=DEEPSPEED_TOLERANCE):
    for name in a:
        diff = (a[name] - b[name]).norm() / b[name].norm()
        assert diff < tolerance, f"{name}: {diff:.2e}"


@STAGES
def test_two_ranks_under_zero_train_as_one_process_taking_each_step_at_once(tmp_path, stage, env):
    kind = f"zero{stage}"
    ranks, weights = launch(tmp_path, "micro", kind, micro=1, world_size=2, env=env)
    # the plain Trainer (no DeepSpeed), one process, each step in one micro-batch, in the run's dtype: shared by the
    # stages of that dtype
    whole, whole_weights = launch(tmp_path, "whole", "trainer", micro=8, world_size=1, env=same_dtype(env))
    assert ranks[0]["world_size"] == 2 and ranks[0]["plan"] == whole[0]["plan"]
    assert min(log["adaptive_batch/accumulation_steps"] for log in ranks[0]["logs"]) > 1
    assert {log["adaptive_batch/accumulation_steps"] for log in whole[0]["logs"]} == {1}
    for key in COUNTS:  # every sample once, the global batch of the plan at every step
        assert [log[key] for log in ranks[0]["logs"]] == [log[key] for log in whole[0]["logs"]], key
    assert_same_weights(weights[0], weights[1])
    assert_close(weights[0], whole_weights[0])
    assert not any("adaptive_batch/noise_scale" in log for log in ranks[0]["logs"])  # not measured under ZeRO


@pytest.mark.parametrize("stage, env", [(2, None), (3, FLOAT32), (2, OFFLOAD)], ids=["2", "3", "2-offload"])
def test_one_process_under_zero_retries_an_out_of_memory_error_exactly(tmp_path, stage, env):
    # in the middle of the backward of the first step's last micro-batch, the accumulation boundary: the first
    # micro-batch's gradients are reduced (offloaded: in the CPU buffers), the boundary's work half done, the reduce
    # bucket half filled; ZeRO-3 gathered parameters besides (a retry without compat/deepspeed.py's deepspeed_reset
    # asserts "already reduced")
    kind = f"zero{stage}"
    retried, weights = launch(
        tmp_path,
        "oom",
        kind,
        micro=2,
        world_size=1,
        fake_oom_rank=0,
        distributed=True,
        env={**(env or {}), "WORKER_OOM_AFTER": "1"},
    )
    assert retried[0]["raised"] == [2]
    assert {log["adaptive_batch/micro_batch_size"] for log in retried[0]["logs"]} == {1}
    clean_env = {**(env or {}), "WORKER_PADDED": "1"}  # the layout of the run with the fake error
    clean, clean_weights = launch(
        tmp_path, "clean", kind, micro=1, world_size=1, distributed=True, env=clean_env
    )
    assert [log["loss"] for log in retried[0]["logs"]] == [log["loss"] for log in clean[0]["logs"]]
    assert_same_weights(weights[0], clean_weights[0])


def test_one_ranks_out_of_memory_under_zero_ends_every_rank_with_the_error(tmp_path):
    stderr = launch(tmp_path, "oom", "zero2", micro=2, world_size=2, fake_oom_rank=1, fails=True)
    assert "EngineOutOfMemoryError: Out of memory in a micro-batch under DeepSpeed with 2 processes" in stderr
    assert "adaptive-batch probe" in stderr


def test_a_resume_from_a_deepspeed_checkpoint_is_exact(tmp_path):
    saving = {"WORKER_ARGS": json.dumps({"save_strategy": "steps", "save_steps": 3})}
    full, full_weights = launch(tmp_path, "full", "zero2", micro=1, world_size=2, env=saving)
    checkpoint = tmp_path / "full" / "checkpoint-3"
    assert (checkpoint / "global_step3").is_dir()  # DeepSpeed's step count is the Trainer's
    resumed, resumed_weights = launch(
        tmp_path, "resumed", "zero2", micro=1, world_size=2, env={"WORKER_RESUME": str(checkpoint)}
    )
    assert [log["loss"] for log in resumed[0]["logs"]] == [log["loss"] for log in full[0]["logs"]]
    assert_same_weights(resumed_weights[0], full_weights[0])
