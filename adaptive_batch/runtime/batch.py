"""Cutting one collated step batch into micro-batches without changing the step's gradient: rows longest first,
trailing padding cut off where exact. See docs/how-it-works.md, "Data, cuts and measurements"."""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import cached_property
from typing import Any

import torch

from ..core.cut import cheapest_chunks, fewest_chunks

IGNORE_INDEX = -100
LABEL_KEYS = ("labels", "shift_labels")
PACKED_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "seq_idx")  # what padding-free collators add


def is_packed(batch: Mapping[str, Any]) -> bool:
    """Whether a collated batch is padding-free: sequence boundaries, or one row whose `position_ids` start again."""
    if any(key in batch for key in PACKED_KEYS):
        return True
    position_ids = batch.get("position_ids")
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[0] != 1:
        return False
    return bool((position_ids[0, 1:] - position_ids[0, :-1] != 1).any())


class StepBatch:
    """One rank's share of an optimizer step's collated batch, to be cut into micro-batches by rows."""

    packed = False  # rows of their own, not sequences flattened into one row

    def __init__(
        self,
        batch: Mapping[str, Any],
        unmasked: bool = False,
        positions: bool = False,
        align: int = 1,
        trims: bool = True,
    ):
        """`unmasked`: a causal LM's rows, whose micro-batches leave the padding mask out where that changes nothing
        ([`mask_changes_nothing`]; `positions`: giving `position_ids` in its place); `align`: the collator's
        `pad_to_multiple_of`, which trimmed micro-batches keep; `trims`: cut a micro-batch short of trailing padding
        (`False`: a model whose rows depend on their padding, [`model_checks.check_layout`])."""
        self.batch = batch
        self.rows = _count_rows(batch)
        _check_splittable(batch, self.rows)
        mask = batch.get("attention_mask")
        self.mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        self.seq_len = _sequence_length(batch)
        # a trimmed micro-batch keeps the collator's pad_to_multiple_of (the tensor cores' alignment, or a chunked
        # attention's, as Reformer's, which refuses other lengths)
        self.align = math.gcd(self.seq_len, align) if self.seq_len else 1
        if self.mask is not None:
            self.lengths = self.mask.sum(dim=1)
            self.order = torch.argsort(self.lengths, descending=True, stable=True)
        else:
            self.lengths, self.order = None, torch.arange(self.rows)
        self.trimmable = trims and self._can_trim()
        self.unmasked = unmasked and self.trimmable and mask_changes_nothing(batch)
        self.positions = positions

    def take(self, start: int, size: int) -> dict[str, Any]:
        """Micro-batch of `size` rows from position `start` of the longest-first order, trailing padding cut."""
        index = self.order[start : start + size]
        length = self._kept_length(index) if self.trimmable else None
        chunk = {key: _take(value, index, length) for key, value in self.batch.items()}
        if self.unmasked:
            mask = chunk.pop("attention_mask")
            if self.positions or "position_ids" in chunk:
                chunk["position_ids"] = torch.arange(mask.shape[1], device=mask.device).expand(mask.shape)
        return chunk

    def dummy(self, count_items: bool) -> dict[str, Any]:
        """One row that adds nothing to the gradient, for a rank with fewer micro-batches: labels ignored where the
        loss is normalised by `num_items_in_batch` (`count_items`), else the caller scales its loss to zero."""
        chunk = self.take(self.rows - 1, 1)
        return labels_ignored(chunk) if count_items else chunk

    def tokens(self, start: int, size: int) -> tuple[int, int]:
        """(real tokens, padded tokens) of the micro-batch `take(start, size)` would give."""
        index = self.order[start : start + size]
        if self.seq_len is None:
            return size, size
        padded = size * (self._kept_length(index) if self.trimmable else self.seq_len)
        real = int(self.lengths[index].sum()) if self.lengths is not None else size * self.seq_len
        return real, padded

    def label_counts(self, shifted: bool) -> torch.Tensor | None:
        """Labelled items of each row, as the Trainer counts `num_items_in_batch`: tokens (after a causal LM's shift,
        if `shifted`), a decoder's tokens, or one label of a row (a classifier's); `None` without labels."""
        for key in LABEL_KEYS:
            labels = self.batch.get(key)
            if isinstance(labels, torch.Tensor) and labels.dim() >= 1:
                if key == "labels" and shifted and labels.dim() == 2:
                    labels = labels[:, 1:]
                return (labels != IGNORE_INDEX).reshape(self.rows, -1).sum(dim=1)
        return None

    def token_chunks(self, budget: int, row_cap: int | None = None, overhead: int | None = None) -> list[int]:
        """Micro-batch sizes of at most `budget` padded tokens and `row_cap` rows, longest rows first ([`cut.py`])."""
        if overhead is None:
            return fewest_chunks(self.padded_lengths, budget, row_cap)
        return cheapest_chunks(self.padded_lengths, budget, row_cap, overhead)

    def longest_row(self) -> int:
        return max(self.padded_lengths)

    def padded_tokens(self, start: int, size: int) -> int:
        """Padded tokens of `take(start, size)`: its rows x its first (longest) row's, no device work."""
        return size * self.padded_lengths[start] if size > 0 else 0

    def real_tokens(self) -> int:
        if self.seq_len is None:
            return self.rows
        return int(self.lengths.sum()) if self.lengths is not None else self.rows * self.seq_len

    def _can_trim(self) -> bool:
        """Right-padded rows whose every per-row tensor is per token: a value of a row (a classifier's label, a span's
        start, which indexes the row's width) or another width (a decoder's labels) was not shown to allow the cut."""
        if self.mask is None or self.seq_len is None:
            return False
        if not bool((self.mask[:, :-1] >= self.mask[:, 1:]).all()):  # not right-padded
            return False
        return all(
            per_token(value, self.mask)
            for value in self.batch.values()
            if isinstance(value, torch.Tensor) and value.dim() >= 1
        )

    @cached_property
    def padded_lengths(self) -> list[int]:
        """The length `take` pads each row to alone, longest first (a micro-batch's is its rows' largest)."""
        if self.seq_len is None:
            return [1] * self.rows
        if not self.trimmable:
            return [self.seq_len] * self.rows
        used = self._used()
        positions = torch.arange(1, self.seq_len + 1, device=used.device)
        lengths = (used * positions).amax(dim=1).clamp_min(1)[self.order]
        return (-(-lengths // self.align) * self.align).tolist()

    def _used(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """Positions a row attends to or has a label at (the rest is padding that may be cut)."""
        used = (self.mask if index is None else self.mask[index]).bool()
        for key in LABEL_KEYS:
            labels = self.batch.get(key)
            if per_token(labels, self.mask):
                used = used | ((labels if index is None else labels[index]) != IGNORE_INDEX)
        return used

    def _kept_length(self, index: torch.Tensor) -> int:
        columns = self._used(index).any(dim=0).nonzero()
        kept = int(columns[-1]) + 1 if len(columns) else 1
        return -(-kept // self.align) * self.align


# what a causal LM's padded rows may hold for their mask to be left out: nothing else that reads the padding
MASK_BLIND_KEYS = {"input_ids", "attention_mask", "position_ids", *LABEL_KEYS}


def mask_changes_nothing(batch: Mapping[str, Any]) -> bool:
    """Whether a causal LM's right-padded step batch trains the same without its padding mask: no label on padding,
    `position_ids` counting from 0, no other input (docs/how-it-works.md, "Variable-length data")."""
    mask = batch.get("attention_mask")
    if set(batch) - MASK_BLIND_KEYS or not isinstance(mask, torch.Tensor) or "input_ids" not in batch:
        return False
    padding = mask == 0
    wrong = torch.zeros((), dtype=torch.bool, device=mask.device)
    for key in LABEL_KEYS:
        if isinstance(batch.get(key), torch.Tensor):
            if not per_token(batch[key], mask):  # (a label of a row: not a causal LM's rows)
                return False
            wrong = wrong | (padding & (batch[key] != IGNORE_INDEX)).any()
    position_ids = batch.get("position_ids")
    if isinstance(position_ids, torch.Tensor):
        counted = torch.arange(mask.shape[1], device=mask.device).expand(mask.shape)
        wrong = wrong | (~padding & (position_ids != counted)).any()
    return not bool(wrong)


def per_token(value: Any, mask: torch.Tensor | None) -> bool:
    """Whether `value` holds one entry per token of the rows `mask` covers (`[rows, length]`): a causal LM's labels,
    not a classifier's label of a row, a span's positions or a decoder's labels of their own length."""
    return isinstance(value, torch.Tensor) and mask is not None and value.shape == mask.shape


def labels_ignored(chunk: dict[str, Any]) -> dict[str, Any]:
    """`chunk` with every label ignored (-100): a micro-batch that adds nothing to a summed loss."""
    for key in LABEL_KEYS:
        if isinstance(chunk.get(key), torch.Tensor):
            chunk[key] = torch.full_like(chunk[key], IGNORE_INDEX)
    return chunk


def _count_rows(batch: Mapping[str, Any]) -> int:
    for value in [*(batch.get(key) for key in ("input_ids", "inputs_embeds", "labels")), *batch.values()]:
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return value.shape[0]
    raise ValueError(f"The step batch holds no tensor to cut into micro-batches (keys: {sorted(batch)}).")


def _sequence_length(batch: Mapping[str, Any]) -> int | None:
    for key in ("input_ids", "attention_mask", "labels"):
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.dim() == 2:
            return value.shape[1]
    return None


def _check_splittable(batch: Mapping[str, Any], rows: int) -> None:
    if is_packed(batch):  # (the step runner gives such a batch to `PackedStepBatch`)
        raise ValueError(
            "The step batch is padding-free: cut it with PackedStepBatch, between its sequences."
        )
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] != rows:
            raise ValueError(
                f"The step batch's {key!r} has shape {list(value.shape)}, whose first dimension is not the "
                f"{rows} rows of the batch, so it cannot be cut into micro-batches by rows. Return per-row values "
                "from the data collator, or compute this value inside the model."
            )
        if isinstance(value, (list, tuple)) and len(value) != rows:
            raise ValueError(
                f"The step batch's {key!r} is a {type(value).__name__} of {len(value)} items, not one per row "
                f"({rows} rows), so it cannot be cut into micro-batches by rows."
            )
        if isinstance(value, Mapping):
            raise ValueError(
                f"The step batch's {key!r} is a nested mapping, which AdaptiveBatch cannot cut into micro-batches; "
                "flatten it into top-level per-row tensors in the data collator."
            )


def _take(value: Any, index: torch.Tensor, length: int | None) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return value
        taken = value.index_select(0, index.to(value.device))
        if length is not None and taken.dim() == 2:
            taken = taken[:, :length].contiguous()  # (as a collator's: a model may `.view` it)
        return taken
    if isinstance(value, (list, tuple)):
        return type(value)(value[i] for i in index.tolist())
    return value
