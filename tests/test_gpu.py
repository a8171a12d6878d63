"""On a CUDA device: a real out-of-memory error (the caching allocator capped with a memory fraction) is survived,
the memory of the failed attempt is really freed, and the run equals one that never ran out, bit for bit."""

import os

import pytest
import torch

# deterministic cuBLAS needs a fixed workspace, set before cuBLAS starts (this module is the suite's only CUDA user)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def make_trainer(tmp_path, micro_batch_size):
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments, default_data_collator

    from adaptive_batch import AdaptiveBatch

    torch.manual_seed(0)
    # a 32k vocabulary makes the logits large: about 0.5 GiB per 1,024-token row with their gradient
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=32000,
        use_cache=False,
        attn_implementation="eager",  # eager attention has a deterministic backward
    )
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 32000, (64 * 3, 1024), generator=torch.Generator().manual_seed(0)).tolist()
    dataset = [{"input_ids": r, "attention_mask": [1] * 1024, "labels": r} for r in ids]
    args = TrainingArguments(
        output_dir=str(tmp_path / f"m{micro_batch_size}"),
        per_device_train_batch_size=64,
        gradient_accumulation_steps=1,
        max_steps=3,
        learning_rate=0.1,
        optim="sgd",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    return Trainer(
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=default_data_collator,
        callbacks=[AdaptiveBatch(micro_batch_size=micro_batch_size)],
    )


@pytest.fixture
def deterministic():
    """Deterministic kernels (the embedding's backward adds with atomics otherwise), so that two runs of the same
    micro-batches agree bit for bit."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_real_cuda_out_of_memory_is_survived_exactly(tmp_path, deterministic):
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(6 * 2**30 / total)  # 6 GiB: 64 rows cannot fit, a few can
    try:
        trainer = make_trainer(tmp_path, micro_batch_size=64)
        trainer.train()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    now = trainer.callback_handler.callbacks[-1].current()
    size = now["micro_batch_size"]
    assert now["micro_batch_settled_because"] == "64 ran out of memory" and size < 64
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert [log["adaptive_batch/effective_batch_size"] for log in logs] == [64, 64, 64]
    assert logs[0]["adaptive_batch/micro_batch_size"] == size
    # the failed attempts left nothing behind: the same as a run that used the final size from the start
    reference = make_trainer(tmp_path, micro_batch_size=size)
    reference.train()
    for (name, a), (_, b) in zip(trainer.model.named_parameters(), reference.model.named_parameters()):
        assert torch.equal(a, b), name
    print(f"64 ran out of memory, settled at {size}")
