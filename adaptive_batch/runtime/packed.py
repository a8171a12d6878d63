"""Cutting a padding-free step batch (sequences flattened into one row) between its sequences, each micro-batch one row
or (`width`) rows of that many tokens; [`flatten_padded`] makes such a row from a padded batch. See
docs/how-it-works.md, "Padding-free and packed data"."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..core.cut import fewest_chunks, rows_first_fit
from .batch import IGNORE_INDEX, LABEL_KEYS, labels_ignored

# the per-sequence fields a micro-batch of sequences gets rebuilt
SEQUENCE_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
ROW_ALIGN = 64  # a packed row's width is a multiple of this (fewer shapes, aligned kernels)


class PackedStepBatch:
    """One rank's share of a padding-free step batch (`[1, tokens]`), cut between its sequences, its "rows".

    `rows`: each micro-batch packed into rows as wide as the step's longest sequence (rounded up to `ROW_ALIGN`),
    longest first, each into the first row with room, `position_ids` starting again at every sequence and at every
    row's unused tail, so that eager and sdpa attention mask each row block-diagonally at a cost in proportion to its
    width, not to all the micro-batch's tokens."""

    packed = True  # its "rows" are sequences flattened into one row

    def __init__(self, batch: Mapping[str, Any], rows: bool = False):
        self.batch = batch
        self.tokens_total = _token_count(batch)
        self.starts = _sequence_starts(batch, self.tokens_total)
        self.ends = self.starts[1:] + [self.tokens_total]
        self.lengths_list = [end - start for start, end in zip(self.starts, self.ends)]
        self.rows = len(self.starts)
        self.seq_len = max(self.lengths_list)
        self.width = -(-self.seq_len // ROW_ALIGN) * ROW_ALIGN if rows else None
        # sequences keep their order (no padding to group away), or go longest first to be packed into rows
        lengths = torch.tensor(self.lengths_list)
        self.order = torch.argsort(lengths, descending=True, stable=True) if rows else torch.arange(self.rows)
        self.ordered = lengths[self.order].tolist()
        _check_cuts(batch, self.starts, self.tokens_total)

    def take(self, start: int, size: int) -> dict[str, Any]:
        """The micro-batch of sequences `start` to `start + size`, its per-sequence fields rebuilt."""
        if self.width is not None:
            return self._rows(self.order[start : start + size].tolist())
        first, last = self.starts[start], self.ends[start + size - 1]
        lengths = self.lengths_list[start : start + size]
        taken = {
            key: value[:, first:last].contiguous()
            if isinstance(value, torch.Tensor) and value.dim() == 2
            else value
            for key, value in self.batch.items()
            if key not in SEQUENCE_KEYS
        }
        cumulative = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            if key in self.batch:
                taken[key] = cumulative.to(self.batch[key].device, self.batch[key].dtype)
        for key in ("max_length_q", "max_length_k"):
            if key in self.batch:
                taken[key] = max(lengths)
        if "seq_idx" in self.batch:
            seq_idx = self.batch["seq_idx"]
            counts = torch.tensor(lengths, device=seq_idx.device)
            ids = torch.arange(size, device=seq_idx.device, dtype=seq_idx.dtype)
            taken["seq_idx"] = torch.repeat_interleave(ids, counts).unsqueeze(0)
        return taken

    def dummy(self, count_items: bool) -> dict[str, Any]:
        """The shortest sequence, adding nothing (see `StepBatch.dummy`)."""
        shortest = min(range(self.rows), key=lambda i: self.ordered[i])
        chunk = self.take(shortest, 1)
        return labels_ignored(chunk) if count_items else chunk

    def tokens(self, start: int, size: int) -> tuple[int, int]:
        return sum(self.ordered[start : start + size]), self.padded_tokens(start, size)

    def token_chunks(self, budget: int, row_cap: int | None = None, overhead: int | None = None) -> list[int]:
        """The fewest micro-batches of at most `budget` tokens, in order: without padding also the cheapest."""
        return fewest_chunks(self.ordered, budget, row_cap, packed=True, width=self.width)

    def longest_row(self) -> int:
        return self.width or self.seq_len

    def padded_tokens(self, start: int, size: int) -> int:
        """The tokens `take(start, size)` runs: its sequences', or its rows' where packed into rows."""
        lengths = self.ordered[start : start + size]
        return len(rows_first_fit(lengths, self.width)) * self.width if self.width else sum(lengths)

    def real_tokens(self) -> int:
        return self.tokens_total

    def label_counts(self, shifted: bool) -> torch.Tensor | None:
        """Labelled tokens of each sequence (each starts with an ignored label, so a shift changes nothing)."""
        labels = next((self.batch[k] for k in LABEL_KEYS if torch.is_tensor(self.batch.get(k))), None)
        if labels is None:
            return None
        labelled = (labels[0] != IGNORE_INDEX).long()
        return torch.stack([labelled[s:e].sum() for s, e in zip(self.starts, self.ends)])

    def _rows(self, sequences: list[int]) -> dict[str, Any]:
        """`sequences` (indices) packed into rows of `width` tokens ([`cut.rows_first_fit`]); a row's unused tail is a
        sequence of its own (no label), so that no real token attends to it. Every sequence's first label is already
        ignored ([`flattened`], the only source of a batch packed into rows), so none is a target across a row."""
        packing = rows_first_fit([self.lengths_list[i] for i in sequences], self.width)
        spans = [[(self.starts[sequences[i]], self.ends[sequences[i]]) for i in row] for row in packing]
        pieces = [[end - start for start, end in row] for row in spans]
        used = [sum(sizes) for sizes in pieces]
        out: dict[str, Any] = {}
        for key, value in self.batch.items():
            if key in SEQUENCE_KEYS or not isinstance(value, torch.Tensor) or value.dim() != 2:
                continue
            rows = value.new_full((len(spans), self.width), IGNORE_INDEX if key in LABEL_KEYS else 0)
            for r, row in enumerate(spans):
                rows[r, : used[r]] = torch.cat([value[0, start:end] for start, end in row])
            out[key] = rows
        # positions start again at each sequence and at the row's unused tail
        restarts = [[*sizes, self.width - total] for sizes, total in zip(pieces, used)]
        positions = torch.stack([torch.cat([torch.arange(n) for n in sizes]) for sizes in restarts])
        out["position_ids"] = positions.to(next(iter(out.values())).device)
        return out


def why_not_flat(batch: Mapping[str, Any]) -> str | None:
    """Why a padded step batch cannot be flattened with the same loss terms ([`flatten_padded`]); `None`: it can."""
    mask = batch.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return (
            "Padding-free steps (padding_free=True, or chosen for the attention) need the step batch's attention_mask "
            "([rows, length]) to flatten it"
        )
    rows, width = mask.shape
    if not bool((mask[:, :-1] >= mask[:, 1:]).all()):
        return (
            "Padding-free steps flatten right-padded rows, and this step batch's attention_mask has padding before a "
            "token (left padding would move every position)"
        )
    for key, value in batch.items():
        if key == "attention_mask":
            continue
        if key == "shift_labels" or not isinstance(value, torch.Tensor) or value.shape[:2] != (rows, width):
            shape = list(value.shape) if isinstance(value, torch.Tensor) else "a " + type(value).__name__
            return (
                f"Padding-free steps flatten per-token tensors ([{rows}, {width}]), and the step batch's {key!r} is "
                f"{shape}"
            )
        if key == "labels" and bool((value[~mask.bool()] != IGNORE_INDEX).any()):
            return "The step batch has labels on padding, which padding-free steps would drop"
    return None


def flatten_padded(batch: Mapping[str, Any]) -> dict[str, Any]:
    """A right-padded step batch as one padding-free row: each row's real tokens end to end, `position_ids` starting
    again at each, each row's first label ignored (never a target), so the loss terms are the padded batch's."""
    why = why_not_flat(batch)
    if why is not None:
        fix = (
            "use a right-padding collator, or pass AdaptiveBatch(padding_free=False) to keep the padded rows"
        )
        raise ValueError(f"{why}; {fix}.")
    return flattened(batch)


def flattened(batch: Mapping[str, Any]) -> dict[str, Any]:
    """[`flatten_padded`] of a batch that [`why_not_flat`] passed."""
    mask = batch["attention_mask"]
    keep = mask.bool()
    flat: dict[str, Any] = {}
    for key, value in batch.items():
        if key == "attention_mask":
            continue
        if key == "labels":
            value = value.clone()
            value[:, 0] = IGNORE_INDEX  # never a target within its row; no target across rows once flattened
        flat[key] = value[keep].unsqueeze(0)
    lengths = mask.sum(dim=1)
    flat["position_ids"] = torch.cat([torch.arange(int(n), device=mask.device) for n in lengths]).unsqueeze(0)
    return flat


def check_packed_inputs(batch: Mapping[str, Any], model: torch.nn.Module) -> None:
    """Refuse a padding-free batch whose sequences would attend to each other (`attention_mask`, `use_cache`)."""
    if batch.get("attention_mask") is not None:
        raise ValueError(
            "The padding-free step batch carries an attention_mask, so eager and sdpa attention let its packed "
            "sequences attend to each other (transformers builds the block-diagonal mask from position_ids only "
            "without one). Leave attention_mask out of the collated batch (DataCollatorWithFlattening and TRL's "
            "padding_free collator do), or pad the sequences instead of flattening them."
        )
    inner = getattr(model, "module", model)  # (DDP wraps the model)
    config = getattr(inner, "config", getattr(model, "config", None))
    if batch.get("use_cache") is not False and getattr(config, "use_cache", False):
        raise ValueError(
            "The model would run with use_cache=True, and with a cache transformers does not tell packed "
            "sequences apart, so they would attend to each other. Train with TrainingArguments(use_cache=False), "
            "its default (the Trainer sets model.config.use_cache from it; TRL's SFTTrainer passes "
            "use_cache=False itself)."
        )


def _token_count(batch: Mapping[str, Any]) -> int:
    for key in ("input_ids", "inputs_embeds", "labels", "position_ids"):
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            if value.shape[0] != 1:
                raise ValueError(
                    f"The padding-free step batch's {key!r} has shape {list(value.shape)}: AdaptiveBatch expects "
                    "one row of flattened sequences ([1, tokens]), as DataCollatorWithFlattening makes."
                )
            return value.shape[1]
    raise ValueError(f"The padding-free step batch holds no [1, tokens] tensor (keys: {sorted(batch)}).")


def _sequence_starts(batch: Mapping[str, Any], total: int) -> list[int]:
    """Where each sequence starts: from `position_ids`, checked against `cu_seq_lens_q` where given."""
    position_ids = batch.get("position_ids")
    starts = None
    if isinstance(position_ids, torch.Tensor) and position_ids.shape == (1, total):
        steps = position_ids[0, 1:] - position_ids[0, :-1]
        starts = [0] + ((steps != 1).nonzero().flatten() + 1).tolist()
    cu = batch.get("cu_seq_lens_q", batch.get("cu_seqlens"))
    if isinstance(cu, torch.Tensor):
        bounds = cu.tolist()
        if bounds[0] != 0 or bounds[-1] != total:
            raise ValueError(
                f"The padding-free step batch's cu_seq_lens run from {bounds[0]} to {bounds[-1]}, not over its "
                f"{total} tokens; check the data collator."
            )
        if starts is not None and starts != bounds[:-1]:
            raise ValueError(
                "The padding-free step batch's position_ids and cu_seq_lens_q disagree on where sequences start "
                f"({starts[:8]} against {bounds[:-1][:8]}); check the data collator."
            )
        starts = bounds[:-1]
    if starts is None:
        raise ValueError(
            "The padding-free step batch has neither position_ids of its [1, tokens] shape nor cu_seq_lens_q, so its "
            "sequences cannot be told apart; use DataCollatorWithFlattening (it returns position_ids)."
        )
    return starts


def _check_cuts(batch: Mapping[str, Any], starts: list[int], total: int) -> None:
    """Every sequence start is a possible cut: its label must be ignored, and every tensor must be per token."""
    for key, value in batch.items():
        if key in (*SEQUENCE_KEYS, "cu_seqlens") or not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        if value.dim() != 2 or value.shape != (1, total):
            raise ValueError(
                f"The padding-free step batch's {key!r} has shape {list(value.shape)}, neither per token ([1, "
                f"{total}]) nor a per-sequence field AdaptiveBatch rebuilds ({', '.join(SEQUENCE_KEYS)}), so it "
                "cannot be cut between sequences. Return it per token from the data collator."
            )
    for key in LABEL_KEYS:
        labels = batch.get(key)
        if not isinstance(labels, torch.Tensor):
            continue
        bad = [s for s in starts[1:] if int(labels[0, s]) != IGNORE_INDEX]
        if bad:
            raise ValueError(
                f"The padding-free step batch's {key!r} is {int(labels[0, bad[0]])} at position {bad[0]}, where a "
                "sequence starts: a cut there would drop the loss term that pairs the previous sequence's last "
                "token with it, and keeping it would train one sequence to predict the next. Ignore (-100) the "
                "first label of every sequence: DataCollatorWithFlattening(separator_id=-100), the default."
            )
