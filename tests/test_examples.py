"""Every example runs as is, at its smallest setting, so that none rots."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


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
    ],
)
def test_the_example_runs(script, argv, expected):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *argv], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for text in expected:
        assert text in result.stdout, (text, result.stdout[-3000:])
