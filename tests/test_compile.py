"""Under a compiling attention (flex attention compiles its kernels with torch.compile), AdaptiveBatch's search over
sizes does not compile once per size tried: after the first change of shape dynamo compiles the varying dimensions
as dynamic, so the sizes tried later reuse the graphs. On the CPU flex attention has no backward, so the evaluation
search ("grow": the eval batch doubles between evaluations) stands for the training search here; the GPU benchmark
(benchmarks/ragged_throughput.py, `steps_that_compiled`) counts the training search's graphs."""

import pytest
import torch
from helpers import BlockClock
from torch._dynamo.utils import counters

import adaptive_batch.runtime.memory
from adaptive_batch import AdaptiveBatch


@pytest.mark.slow
def test_the_eval_batch_search_under_flex_attention_compiles_no_graph_per_size_tried(
    make_trainer, rows, monkeypatch
):
    # evaluations timed as if each doubling paid (compilation would make the real clock say otherwise): 2, 4, 8, 16
    monkeypatch.setattr(adaptive_batch.runtime.memory, "time", BlockClock([4.0, 2.0, 1.0, 0.5]))
    torch._dynamo.reset()
    counters.clear()
    trainer = make_trainer(
        [AdaptiveBatch(adapt_evaluation="grow")], eval_dataset=rows[:27], per_device_eval_batch_size=2
    )
    trainer.model.config._attn_implementation = "flex_attention"
    sizes, graphs = [], []
    for _ in range(4):
        metrics = trainer.evaluate()
        sizes.append(metrics["eval_adaptive_batch/micro_batch_size"])
        graphs.append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    assert sizes == [2, 4, 8, 16]  # the search tried sizes, so the shapes changed
    assert graphs[0] > 0  # flex attention compiled
    assert graphs[-1] == graphs[1], (sizes, graphs)  # the sizes after the first two compiled nothing new
