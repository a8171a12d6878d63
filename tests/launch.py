"""Launching tests/ddp_worker.py in one process or several (gloo) and reading back what every rank wrote: shared by
test_ddp.py and test_deepspeed.py, with the reference runs they compare against.

A run that must succeed forks its ranks from a fork server (`multiprocessing`'s "forkserver") that imported torch,
transformers, peft, TRL and DeepSpeed once: each process of a launch would otherwise spend about 11 s of CPU importing
them. Each rank gets the environment torchrun gives its ranks, one torch thread (torchrun's OMP_NUM_THREADS=1) and
runs the worker as `__main__`; test_ddp.py checks such a launch against torchrun's, bit for bit. A run that must fail,
or one asked for `via_torchrun`, runs under torchrun itself (its stderr is what those tests read)."""

import json
import multiprocessing
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
import uuid
from multiprocessing.connection import wait
from pathlib import Path

import pytest
import torch
from helpers import ORDER_TOLERANCE

WORKER = Path(__file__).with_name("ddp_worker.py")
TIMEOUT = 240  # seconds a launch may take before it counts as a hang
BASE_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def launch(
    tmp_path,
    name,
    kind,
    micro,
    world_size,
    fake_oom_rank=None,
    distributed=False,
    fails=False,
    env=None,
    via_torchrun=False,
):
    """Run the worker in `world_size` processes (with torchrun's environment if more than one, or if `distributed`);
    return every rank's results and weights, or with `fails`, the launcher's stderr of a run that must fail.

    A run that succeeds is kept for the session: a later launch with the same arguments (the reference runs that
    several tests compare against) gets the same results without running again. The worker is deterministic, and
    callers only read what they get."""
    key = (
        kind,
        str(micro),
        world_size,
        fake_oom_rank,
        distributed,
        json.dumps(env or {}, sort_keys=True),
        via_torchrun,
    )
    if not fails and key in _RUNS:
        return _RUNS[key]
    out = tmp_path / name
    out.mkdir()
    argv = [str(out), kind, str(micro), *([str(fake_oom_rank)] if fake_oom_rank is not None else [])]
    env = {**os.environ, **BASE_ENV, **(env or {})}
    if fails or via_torchrun:
        stderr = _torchrun(name, argv, world_size, env, fails)
        if fails:
            return stderr
    else:
        _forked(name, out, argv, world_size, world_size > 1 or distributed, env)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
    weights = [torch.load(out / f"rank{r}.pt") for r in range(world_size)]
    _RUNS[key] = results, weights
    return results, weights


def _torchrun(name, argv, world_size, env, fails):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(world_size),
        "--standalone",
    ]
    # a process group of its own, so that a hang is ended whole: the launcher and every rank
    process = subprocess.Popen(
        [*command, str(WORKER), *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail(f"{name}: the ranks did not finish within {TIMEOUT} s (a hang)")
    assert (process.returncode != 0) if fails else (process.returncode == 0), stderr[-4000:]
    return stderr


def _forked(name, out, argv, world_size, distributed, env):
    """The ranks forked from the fork server, with torchrun's environment where `distributed`. Where a rank fails,
    the others are killed, as torchrun does; each rank's output is in `out/rank<r>.log`."""
    dist = _torchrun_env(world_size) if distributed else {}
    processes = [
        _context().Process(
            target=_run_rank, args=(str(out / f"rank{r}.log"), argv, {**env, **dist.get(r, {})})
        )
        for r in range(world_size)
    ]
    for process in processes:
        process.start()
    deadline, failed = time.monotonic() + TIMEOUT, None
    while failed is None and any(p.exitcode is None for p in processes) and time.monotonic() < deadline:
        wait(
            [p.sentinel for p in processes if p.exitcode is None], timeout=max(deadline - time.monotonic(), 0)
        )
        failed = next((r for r, p in enumerate(processes) if p.exitcode not in (None, 0)), None)
    hung = failed is None and any(p.exitcode is None for p in processes)
    for process in processes:
        if process.exitcode is None:
            process.kill()
        process.join()
    if hung:
        pytest.fail(f"{name}: the ranks did not finish within {TIMEOUT} s (a hang)")
    if failed is not None:
        log = (out / f"rank{failed}.log").read_text()[-4000:]
        pytest.fail(f"{name}: rank {failed} ended with exit code {processes[failed].exitcode}:\n{log}")


def _torchrun_env(world_size: int) -> dict[int, dict[str, str]]:
    """What torchrun --standalone puts in each rank's environment (a free port on this machine for the rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shared = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_NAME": "default",
        "ROLE_WORLD_SIZE": str(world_size),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": uuid.uuid4().hex,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }
    return {
        r: {**shared, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)} for r in range(world_size)
    }


def _run_rank(log: str, argv: list[str], env: dict[str, str]) -> None:
    """One rank, in a process forked from the fork server: its own environment and output, then the worker."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    # a script's default start method here (its DataLoader workers fork), not the fork server's
    multiprocessing.set_start_method("fork", force=True)
    sys.argv = [str(WORKER), *argv]
    sys.path.insert(0, str(WORKER.parent))
    runpy.run_path(str(WORKER), run_name="__main__")


_CONTEXT = None


def _context():
    """The fork server, started on the first launch of this process, with the libraries the worker imports."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["launch", "transformers", "peft", "trl", "deepspeed", "accelerate"])
    return _CONTEXT


_RUNS: dict[tuple, tuple[list[dict], list[dict]]] = {}  # launch's runs that succeeded, by their arguments


def assert_close_weights(a, b):
    for name in a:
        diff = (a[name] - b[name]).norm() / b[name].norm()
        assert diff < ORDER_TOLERANCE, f"{name}: {diff:.2e}"


def assert_same_weights(a, b):
    for name in a:
        assert torch.equal(a[name], b[name]), name
