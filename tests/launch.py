"""Launching tests/ddp_worker.py in one process or several (torchrun, gloo) and reading back what every rank wrote:
shared by test_ddp.py and test_deepspeed.py, with the reference runs they compare against."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ORDER_TOLERANCE

WORKER = Path(__file__).with_name("ddp_worker.py")


def launch(
    tmp_path, name, kind, micro, world_size, fake_oom_rank=None, torchrun=False, fails=False, env=None
):
    """Run the worker in `world_size` processes (under torchrun if more than one, or if `torchrun`); return every
    rank's results and weights, or with `fails`, the launcher's stderr of a run that must fail.

    A run that succeeds is kept for the session: a later launch with the same arguments (the reference runs that
    several tests compare against) gets the same results without running again. The worker is deterministic, and
    callers only read what they get."""
    key = (kind, str(micro), world_size, fake_oom_rank, torchrun, json.dumps(env or {}, sort_keys=True))
    if not fails and key in _RUNS:
        return _RUNS[key]
    out = tmp_path / name
    out.mkdir()
    extra = [str(fake_oom_rank)] if fake_oom_rank is not None else []
    if world_size == 1 and not torchrun:
        command = [sys.executable, str(WORKER), str(out), kind, str(micro), *extra]
    else:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(world_size),
            "--standalone",
            str(WORKER),
            str(out),
            kind,
            str(micro),
            *extra,
        ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    # a process group of its own, so that a hang is ended whole: the launcher and every rank
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _, stderr = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail(f"{name}: the ranks did not finish within 240 s (a hang)")
    if fails:
        assert process.returncode != 0
        return stderr
    assert process.returncode == 0, stderr[-4000:]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
    weights = [torch.load(out / f"rank{r}.pt") for r in range(world_size)]
    _RUNS[key] = results, weights
    return results, weights


_RUNS: dict[tuple, tuple[list[dict], list[dict]]] = {}  # launch's runs that succeeded, by their arguments


def assert_close_weights(a, b):
    for name in a:
        diff = (a[name] - b[name]).norm() / b[name].norm()
        assert diff < ORDER_TOLERANCE, f"{name}: {diff:.2e}"


def assert_same_weights(a, b):
    for name in a:
        assert torch.equal(a[name], b[name]), name
