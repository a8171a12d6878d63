"""Token counts of a training dataset, read without running its transforms; `None` where they cannot be."""

from __future__ import annotations

from collections.abc import Mapping


def is_hf_dataset(dataset) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(dataset, datasets.Dataset)


def row_lengths(dataset) -> list[int] | None:
    """The length of every row's `input_ids` (a `datasets.Dataset`'s whole table), or `None` where not cheap."""
    if is_hf_dataset(dataset):
        if "input_ids" not in dataset.column_names or len(dataset) == 0:
            return None
        import pyarrow.compute as pc

        return pc.list_value_length(dataset.data.column("input_ids")).to_numpy().tolist()
    if isinstance(dataset, (list, tuple)) and dataset:
        if all(isinstance(row, Mapping) and "input_ids" in row for row in dataset):
            return [len(row["input_ids"]) for row in dataset]
    return None


def total_tokens(dataset) -> int | None:
    lengths = row_lengths(dataset)
    return None if lengths is None else sum(lengths)


def longest(dataset) -> int | None:
    lengths = row_lengths(dataset)
    return None if lengths is None else max(lengths)


def step_row_lengths(batch) -> list[int] | None:
    """The tokens of each row of a collated, padded step batch (its `attention_mask`'s ones), or `None`."""
    import torch

    mask = batch.get("attention_mask") if hasattr(batch, "get") else None
    return mask.sum(dim=1).tolist() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
