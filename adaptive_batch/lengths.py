"""Token counts of a training dataset, read without touching its rows (Arrow columns of a `datasets.Dataset`)."""

from __future__ import annotations


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


def total_tokens(dataset) -> int | None:
    lengths = input_ids_lengths(dataset)
    return None if lengths is None else int(lengths.to_numpy().sum())


def longest(dataset) -> int | None:
    lengths = input_ids_lengths(dataset)
    return None if lengths is None else int(lengths.to_numpy().max())
