"""Every example runs as is, at its smallest setting, so that none rots. Each is a process of its own (two under
accelerate launch), 7 to 10 s on two CPU cores: slow."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# under `pytest -n 2 --dist loadgroup`, one worker runs the tests that launch several processes, one after another
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("launch")]


@pytest.mark.parametrize(
    "script, argv, expected",
    [
        (
            "finetune_cpu.py",
            ["--samples", "48", "--epochs", "1"],
            ["micro-batch:", "evaluation: epoch 1: loss"],
        ),
        (
            "phase_warmup.py",
            ["--samples", "48", "--epochs", "1"],
            ["The plan, before any compute:", "What each phase ran:", "48 samples in 3 optimizer steps"],
        ),
        (
            "max_steps_trap.py",
            ["--max-steps", "20"],
            [
                "The trap: batch 128 with the same max_steps took 128x the samples",
                "the data stayed 20 samples (max_steps=20 x the starting batch of 1)",
                "its largest step held 11 samples",  # the phase of 32 the budget ends in holds its rest
                # (the samples' number follows the rows pydoc_data.topics gives, which differ by CPython release)
                "from max_steps=20 steps of the plain Trainer at the starting effective batch 128",
            ],
        ),
    ],
)
def test_the_example_runs(script, argv, expected):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *argv], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for text in expected:
        assert text in result.stdout, (text, result.stdout[-3000:])


def test_the_example_runs_under_accelerate_launch_on_two_processes():
    # the README's command; `--cpu --num_processes 2` would start one process
    command = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    script = [str(EXAMPLES / "finetune_cpu.py"), "--samples", "48", "--epochs", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [sys.executable, *command, *script], capture_output=True, text=True, timeout=600, env=env
    )
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    evaluations = re.findall(r"evaluation: epoch 1: loss (\S+)", result.stdout)
    # both ranks evaluated, and agree
    assert len(evaluations) == 2 and evaluations[0] == evaluations[1], result.stdout[-3000:]


def test_an_example_trains_a_local_model_folder(tmp_path, tokenizer):
    # what --model DIR loads on a GPU: here a small model saved as a user's folder would be
    from adaptive_batch.testing import tiny_llama

    folder = tmp_path / "model"
    tiny_llama(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    argv = ["--samples", "48", "--epochs", "1", "--model", str(folder)]
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "phase_warmup.py"), *argv],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "48 samples in 3 optimizer steps" in result.stdout
