"""Token counts of a training dataset, read without running its transforms: the Arrow column of a
`datasets.Dataset`, or the `input_ids` of a list of mappings. Other datasets are not read (`None`)."""

from __future__ import annotations

from collections.abc import Mapping


def is_hf_dataset(dataset) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(dataset, datasets.Dataset)


def input_ids_lengths(dataset):
    """The length of every row's `input_ids` as an Arrow array, or `None` when they cannot be read cheaply.

    Only a `datasets.Dataset` with an `input_ids` column qualifies. Its underlying table is read, so a dataset with
    an indices mapping (after `select` or `shuffle`) is counted over all its table's rows.
    """
    try:
        import datasets
    except ImportError:
        return None
    if (
        not isinstance(dataset, datasets.Dataset)
        or "input_ids" not in dataset.column_names
        or len(dataset) == 0
    ):
        return None
    import pyarrow.compute as pc

    return pc.list_value_length(dataset.data.column("input_ids"))


def row_lengths(dataset) -> list[int] | None:
    """The length of every row's `input_ids`, or `None` when they cannot be read cheaply."""
    arrow = input_ids_lengths(dataset)
    if arrow is not None:
        return arrow.to_numpy().tolist()
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


def varies(dataset) -> bool:
    """Whether the rows are known to differ in length (a dataset that cannot be read counts as not)."""
    lengths = row_lengths(dataset)
    return lengths is not None and min(lengths) != max(lengths)
