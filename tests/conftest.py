"""Shared fixtures: real text, a tokenizer trained on it, tiny random Llama models, Trainer factories. Fixtures and
hooks only: what tests share besides them is in helpers.py (imported here first, it also sets the environment of
every test run)."""

from __future__ import annotations

import pytest
import torch
from helpers import QUIET_CPU_RUN, keep_loss_in_float64


@pytest.fixture(autouse=True)
def probe_cache(tmp_path, monkeypatch):
    """Every test reads and writes its own probe cache, never the user's."""
    path = tmp_path / "probe-cache"
    monkeypatch.setenv("ADAPTIVE_BATCH_CACHE", str(path))
    return path


@pytest.fixture(scope="session")
def texts():
    from adaptive_batch.testing import text_corpus

    return text_corpus()


@pytest.fixture(scope="session")
def tokenizer(texts):
    from adaptive_batch.testing import train_tokenizer

    return train_tokenizer(texts[:1500], vocab_size=384)


@pytest.fixture(scope="session")
def rows(tokenizer, texts):
    """Tokenised rows of 3 to 32 tokens, varying lengths."""
    from adaptive_batch.testing import token_dataset

    return token_dataset(tokenizer, texts[:400], max_length=32)


@pytest.fixture(scope="session")
def fixed_rows(rows):
    """The same rows, each repeated to exactly 32 tokens: data of one length, where "auto" measures rows (on rows
    of varying length it cuts by tokens)."""
    return [{"input_ids": (row["input_ids"] * 32)[:32]} for row in rows]


@pytest.fixture
def make_trainer(tokenizer, rows, tmp_path):
    """Build a `transformers.Trainer` on a tiny Llama. Keyword arguments go to TrainingArguments, except
    `callbacks`, `model`, `dataset`, `eval_dataset`, `trainer_class`, `num_rows` and `dtype` (float64 makes whole-run comparisons
    tight: Adam divides by the root of tiny second moments, which magnifies float32 rounding over a run)."""
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from adaptive_batch.testing import tiny_llama

    def make(
        callbacks=(),
        model=None,
        dataset=None,
        trainer_class=Trainer,
        num_rows=40,
        dtype=None,
        eval_dataset=None,
        **overrides,
    ):
        settings = dict(
            output_dir=str(tmp_path / "out"),
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            num_train_epochs=1,
            learning_rate=1e-2,
            **QUIET_CPU_RUN,
        )
        settings.update(overrides)
        if model is None:
            model = tiny_llama(tokenizer)
        if dtype is not None:
            model = model.to(dtype)
            if dtype == torch.float64 and hasattr(model, "config"):
                keep_loss_in_float64(model)
        return trainer_class(
            model=model,
            args=TrainingArguments(**settings),
            train_dataset=dataset if dataset is not None else rows[:num_rows],
            eval_dataset=eval_dataset,
            data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
            callbacks=list(callbacks),
        )

    return make


def pytest_collection_finish(session):
    """Leave what exists once the tests are collected (torch's, transformers' and the other libraries' modules, alive
    all run long) out of every garbage collection: each `Trainer.train()` ends with accelerate's `free_memory`, a full
    collection that would walk them all (0.25 s a run on 2 cores, most of a tiny run's time)."""
    import gc

    gc.freeze()
