"""benchmarks/ragged_throughput.py credits every optimizer step with the real tokens that step trained on, for the
plain Trainer (whose dataloader builds one batch ahead) and for AdaptiveBatch: checked against the label tokens each
step's forwards received, on a tiny Llama over rows of varying length."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def ragged_throughput():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(
            "ragged_throughput", BENCHMARKS / "ragged_throughput.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


class ForwardTokens:
    """The real tokens of each step's forwards (padding and the tails of packed rows left out)."""

    def __init__(self, model):
        from transformers import TrainerCallback

        self.per_step, self.current = [], 0
        model.register_forward_pre_hook(self.count, with_kwargs=True)
        seen = self

        class Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                seen.per_step.append(seen.current)
                seen.current = 0

        self.callback = Callback()

    def count(self, module, args, kwargs):
        from helpers import sequences

        # every real token: of padded rows, or of sequences packed into rows (their unused tails left out)
        self.current += sum(map(len, sequences(kwargs)))


@pytest.mark.parametrize("adaptive", [False, True], ids=["plain", "adaptive_batch"])
def test_each_step_is_credited_with_the_tokens_it_trained_on(
    ragged_throughput, tokenizer, rows, tmp_path, adaptive
):
    from helpers import QUIET_CPU_RUN
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from adaptive_batch import AdaptiveBatch
    from adaptive_batch.testing import tiny_llama

    model = tiny_llama(tokenizer)
    collator = ragged_throughput.CountingCollator("pad")
    counted = ragged_throughput.StepTokens(collator, None if adaptive else 2)
    seen = ForwardTokens(model)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=5,
        **QUIET_CPU_RUN,
    )
    built = []  # the batches the collator had built by each step's end

    class Built(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            built.append(len(collator.calls))

    callbacks = [counted.callback, seen.callback, Built()]
    if adaptive:
        callbacks.append(AdaptiveBatch(micro_batch_size=4))
    Trainer(
        model=model, args=args, train_dataset=rows[:80], data_collator=collator, callbacks=callbacks
    ).train()
    assert len(seen.per_step) == 5 and len(set(seen.per_step)) > 1  # steps of varying tokens
    assert counted.per_step == seen.per_step
    # what the count must see past: the plain loop's dataloader had built the next step's first batch too
    assert built[:4] == ([1, 2, 3, 4] if adaptive else [3, 5, 7, 9])
