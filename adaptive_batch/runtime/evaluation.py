"""Evaluation and prediction that survive an out-of-memory error ([`EvalPieces`]), the eval batch grown between
evaluations under `adapt_evaluation="grow"` ([`EvalGrowth`]). See docs/how-it-works.md, "Evaluation"."""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
from collections.abc import Mapping
from functools import partial

import torch

from ..core.cut import cheapest_chunks
from ..core.eval_size import EvalMeasure, EvalSizer
from ..core.microbatch import MicroBatchTooLargeError
from ..core.replay import Tape
from ..core.rows import even_chunk
from ..core.tokens import fitted_overhead
from .batch import IGNORE_INDEX, per_token
from .compat.trainer import forget_eval_dataloaders, loss_normalised_over_ranks, loss_shifts_labels
from .compat.trl import TrlMetrics
from .memory import Stopwatch, memory_limit, release_memory, synchronize
from .ranks import Ranks, Report
from .stream import is_stream

logger = logging.getLogger("adaptive_batch")

# the cut of ragged eval batches: a forward's fixed time is fitted on the last MAX_POINTS forwards, from MIN_POINTS on
MIN_POINTS, MAX_POINTS = 4, 64


class EvalPieces:
    """Runs eval batches through `prediction_step`, in pieces after an OOM (`cut_by_tokens`: by row lengths)."""

    def __init__(self, trainer, world_size: int, cut_by_tokens: bool = False):
        self.trainer, self.ranks, self.cut_by_tokens = trainer, Ranks(trainer, world_size), cut_by_tokens
        # (padded tokens, seconds) of the forwards timed for that cut, and a forward's fixed time fitted from them
        self.points: list[tuple[float, float]] = []
        self.overhead: int | None = None
        self.cap: int | None = None  # the most rows a piece holds since an out-of-memory error (None: any)
        self.failed: list[int] = []  # the sizes that ran out of memory, in order
        self.tape = Tape()  # what decisions read of time and memory: measured, or replayed (the session's)
        self._pieces_at: tuple[int, int] = (-1, 0)  # (step, pieces run at it): names a piece's measurements
        self.begin()

    def begin(self) -> None:
        """A new evaluation starts: its counters from zero (the cap stays)."""
        self.largest, self.retried, self.rows, self.cut_batches = 0, 0, 0, 0

    def run(self, prediction_step, model, inputs, prediction_loss_only: bool, ignore_keys):
        """The Trainer's `prediction_step` of the whole batch: cut by tokens where that pays, in pieces after OOM."""
        predict = lambda piece: prediction_step(model, piece, prediction_loss_only, ignore_keys)
        rows = batch_rows(inputs)
        if rows is None:  # nothing to cut by rows: the Trainer's own step
            return predict(inputs)
        by_tokens = self.cut_by_tokens and prediction_loss_only and self.cap is None
        pieces = self._token_pieces(inputs, rows) if by_tokens else None
        size, retried = rows if self.cap is None else min(rows, self.cap), False
        while True:
            result = self._attempt(predict, inputs, rows, pieces or halves(rows, size))
            if result is not None:
                self.largest = max(self.largest, size)
                self.retried += retried
                self.rows += rows
                self.cut_batches += pieces is not None
                return result
            release_memory(self.ranks.device)  # then in halves of its rows
            self.failed.append(size)
            if size == 1:
                raise MicroBatchTooLargeError(
                    f"One row of an eval batch does not fit in memory on {self.ranks.device}, so no piece of it can "
                    "run. Lower per_device_eval_batch_size does not help here: free memory per row (a shorter "
                    "max_length for the eval set, eval_accumulation_steps to move predictions to the CPU, or "
                    "prediction_loss_only=True to keep no logits).",
                    list(self.failed),
                )
            where = "in pieces of similar lengths" if pieces is not None else f"at {size} rows"
            size = max(1, size // 2)
            self.cap, retried = size, True
            logger.warning(
                f"AdaptiveBatch: out of memory in evaluation {where}; running the eval batch again in pieces of "
                f"{size} {'row' if size == 1 and pieces is None else 'rows'} (the metrics are the whole batch's)."
            )
            pieces = None

    def _token_pieces(self, inputs, rows: int) -> list | None:
        """The batch's rows grouped by length ([`token_pieces`]), as many pieces on every rank; `None`: one piece."""
        pieces = token_pieces(inputs, rows, self.overhead) if self.overhead is not None else None
        if self.ranks.distributed:  # every rank runs as many pieces (a collective follows each)
            count = self.ranks.max([float(len(pieces or [0]))])[0]
            pieces = as_many_pieces(pieces or [(slice(0, rows), None)], int(count), rows)
        return pieces if pieces is not None and len(pieces) > 1 else None

    def metrics(self, prefix: str) -> dict[str, int]:
        """The evaluation's metrics: the largest piece that ran, the batches retried (and cut by tokens)."""
        metrics = {
            f"{prefix}_adaptive_batch/micro_batch_size": self.largest,
            f"{prefix}_adaptive_batch/batches_retried": self.retried,
        }
        if self.cut_by_tokens:
            metrics[f"{prefix}_adaptive_batch/batches_cut_by_tokens"] = self.cut_batches
        return metrics

    def _attempt(self, predict, inputs, rows, pieces):
        """The batch's (loss, logits, labels) from `pieces` (rows, width), or `None` after an OOM on any rank."""
        # (every rank has the same cap: they failed together)
        if self.cap is not None and self.ranks.distributed:
            most, fewest = self.ranks.max([rows, -rows])
            if most != -fewest:
                raise RuntimeError(
                    f"The eval batches hold {int(-fewest)} to {int(most)} rows on different ranks, so they cannot "
                    "run in the same pieces after an out-of-memory error. Keep the Accelerator's even_batches=True "
                    "(its default), or set AdaptiveBatch(adapt_evaluation=False)."
                )
        metrics = TrlMetrics(self.trainer, mode="eval")
        outputs = []
        timed, device = self.cut_by_tokens and not self.ranks.distributed, self.ranks.device

        def piece(index, width: int | None, name: str) -> Report:
            if timed:
                synchronize(device)
                began = time.perf_counter()
            outputs.append(predict(take(inputs, rows, index, width)))
            if timed:
                synchronize(device)
                elapsed = [time.perf_counter() - began]
                (seconds,) = self.tape.measure("eval", self.step, f"forward {name}", elapsed)
                self._timed(inputs, rows, index, width, seconds)
            return Report()

        for index, width in pieces:
            step, count = self._pieces_at
            self._pieces_at = (self.step, count + 1 if step == self.step else 0)
            name = str(self._pieces_at[1])
            work, key = partial(piece, index, width, name), ("eval", self.step, f"oom {name}")
            if self.ranks.run(work, partial(Report, True), self.tape, key).out_of_memory:
                metrics.restore()
                return None
        if len(outputs) > 1:
            local = self._units(inputs, rows, pieces)
            across = self.ranks.sum(local)
            metrics.merge(across)  # TRL's per-batch means over label tokens of every rank
            over_ranks = self.ranks.distributed and loss_normalised_over_ranks(self.trainer)
            return _combine(outputs, across if over_ranks else local)
        return outputs[0]

    @property
    def step(self) -> int:
        return self.trainer.state.global_step

    def _timed(self, inputs, rows: int, index, width: int | None, seconds: float) -> None:
        """A forward of rows `index` at `width` took `seconds`: a point for fitting a forward's fixed time."""
        full = _width(inputs)
        if full is None or seconds <= 0:
            return
        count = len(range(rows)[index]) if isinstance(index, slice) else len(index)
        self.points = [*self.points[-(MAX_POINTS - 1) :], (float(count * (width or full)), seconds)]
        if len(self.points) >= MIN_POINTS:
            self.overhead = fitted_overhead(self.points)

    def _units(self, inputs, rows: int, pieces: list) -> list[float]:
        """What each piece's loss is averaged over on this rank, as the Trainer counts it (label tokens, or rows)."""
        labels = inputs.get("shift_labels")
        if labels is None:
            labels = inputs.get("labels")
            if isinstance(labels, torch.Tensor) and labels.dim() >= 2 and loss_shifts_labels(self.trainer):
                labels = labels[..., 1:]
        per_row = torch.ones(rows, dtype=torch.float64)
        if isinstance(labels, torch.Tensor) and labels.dim() >= 1 and labels.shape[0] == rows:
            per_row = (labels != IGNORE_INDEX).reshape(rows, -1).sum(dim=1).double().cpu()
        return [
            float(per_row[index.cpu() if isinstance(index, torch.Tensor) else index].sum())
            for index, _ in pieces
        ]


class EvalGrowth:
    """`adapt_evaluation="grow"`: each evaluation runs at the eval batch its prefix's [`EvalSizer`] chose."""

    def __init__(self, trainer, pieces: EvalPieces, growth_margin: float, memory_headroom: float):
        self.trainer, self.pieces = trainer, pieces
        self.start = trainer.args.per_device_eval_batch_size
        self.growth_margin, self.memory_headroom = growth_margin, memory_headroom
        self.sizers: dict[str, EvalSizer] = {}
        self.rows: dict[str, int] = {}  # the rows per rank each prefix's last evaluation ran
        self.built_at: int | None = None  # the batch size of the data loaders the Trainer may have kept

    def sizer(self, prefix: str) -> EvalSizer:
        return self.sizers.setdefault(prefix, EvalSizer(self.start, self.growth_margin, self.memory_headroom))

    @contextlib.contextmanager
    def sized(self, prefix: str):
        """Around `evaluate` and `predict`: the data loader and the loop use the chosen size."""
        args = self.trainer.args
        size = self.sizer(prefix).batch_size(self.rows.get(prefix))
        if size != self.built_at:  # loaders kept for persistent workers were built at another size
            forget_eval_dataloaders(self.trainer)
            self.built_at = size
        user, args.per_device_eval_batch_size = args.per_device_eval_batch_size, size
        try:
            yield
        finally:
            args.per_device_eval_batch_size = user

    @contextlib.contextmanager
    def measured(self, prefix: str, dataset):
        """Around `evaluation_loop`: its seconds, peak memory and rows, over all ranks, told to the prefix's sizer."""
        ranks, device = self.pieces.ranks, self.pieces.ranks.device
        size = self.trainer.args.per_device_eval_batch_size
        base = float(torch.cuda.memory_allocated(device)) if device.type == "cuda" else None
        with Stopwatch(device) as watch:
            yield
        readings = [watch.seconds, watch.peak_bytes, base]
        seconds, peak, base = self.pieces.tape.measure("eval", self.pieces.step, "evaluation", readings)
        local = [
            seconds,
            float(self.pieces.rows if is_stream(dataset) else math.ceil(len(dataset) / ranks.world_size)),
            float(self.pieces.retried > 0),  # ran out of memory
            (peak or 0.0) - (base or 0.0),
            base or 0.0,
        ]
        seconds, rows, failed, above, most_base = ranks.max(local)
        self.rows[prefix] = int(rows)
        largest = min(size, self.pieces.cap or size) if failed else size
        peak_and_base = (most_base + above, most_base) if peak is not None else (None, None)
        limit = memory_limit(device, headroom=0.0)  # (the sizer leaves its headroom)
        measure = EvalMeasure(size, int(rows), seconds, largest, *peak_and_base, limit)
        line = self.sizer(prefix).record(measure)
        if line and self.trainer.args.should_log:
            logger.info("AdaptiveBatch: %s", line)


def _combine(outputs: list, units: list[float]):
    """The whole batch's (loss, logits, labels) from its pieces': losses weighted by `units`, the rest joined."""
    losses, logits, labels = ([*parts] for parts in zip(*outputs))
    loss = None
    if all(piece is not None for piece in losses):
        total = sum(units)
        weights = [u / total for u in units] if total > 0 else [1.0 / len(units)] * len(units)
        loss = sum(piece.double() * weight for piece, weight in zip(losses, weights)).to(losses[0].dtype)
    return loss, _concat(logits), _concat(labels)


def batch_rows(inputs) -> int | None:
    """The rows of an eval batch, or `None` where it has no tensor to cut (a padding-free batch is one row)."""
    if not isinstance(inputs, Mapping):
        return None
    tensor = inputs.get("input_ids")
    if not isinstance(tensor, torch.Tensor):
        tensor = next((v for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim() >= 1), None)
    if tensor is None or tensor.dim() == 0 or tensor.shape[0] == 0:
        return None
    return int(tensor.shape[0])


def halves(rows: int, size: int) -> list[tuple[slice, None]]:
    """The batch's rows in order, in near-equal pieces of at most `size`, each at the batch's width."""
    pieces, start = [], 0
    while start < rows:
        piece = even_chunk(rows - start, size)
        pieces.append((slice(start, start + piece), None))
        start += piece
    return pieces


def token_pieces(inputs: Mapping, rows: int, overhead: int) -> list[tuple[torch.Tensor, int]] | None:
    """A right-padded batch's rows grouped by length, each at its longest row's width; `None`: one piece is best."""
    mask = inputs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != rows or rows < 2:
        return None
    # a value of a row (a label, a span's position, which indexes the width) or of another width: one piece
    if not all(per_token(v, mask) for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim() >= 1):
        return None
    width = int(mask.shape[1])
    ones = mask != 0
    if bool((ones[:, 1:] & ~ones[:, :-1]).any()):  # a real token after padding: not right-padded
        return None
    lengths = ones.sum(dim=1).tolist()
    if min(lengths) == width:
        return None
    order = sorted(range(rows), key=lambda row: -lengths[row])
    sizes = cheapest_chunks([lengths[row] for row in order], rows * width, None, overhead=overhead)
    if len(sizes) < 2:
        return None
    bounds = [0, *itertools.accumulate(sizes)]
    groups = [order[start:end] for start, end in zip(bounds, bounds[1:])]
    return [(torch.tensor(group, device=mask.device), max(1, lengths[group[0]])) for group in groups]


def as_many_pieces(pieces: list, count: int, rows: int) -> list:
    """`pieces` split until there are `count`, the largest halved each time, so that every rank runs as many."""
    pieces = list(pieces)
    while len(pieces) < count:
        sizes = [len(range(rows)[index]) if isinstance(index, slice) else len(index) for index, _ in pieces]
        largest = max(range(len(pieces)), key=lambda i: sizes[i])
        if sizes[largest] < 2:
            raise RuntimeError(
                f"An eval batch of {rows} rows cannot run in the {count} pieces another rank's batch needs: the "
                "ranks' eval batches differ in rows. Keep the Accelerator's even_batches=True (its default), or "
                "set AdaptiveBatch(adapt_evaluation=True)."
            )
        index, width = pieces[largest]
        if isinstance(index, slice):
            index = torch.arange(index.start, index.stop)
        half = sizes[largest] // 2
        pieces[largest : largest + 1] = [(index[:half], width), (index[half:], width)]
    return pieces


def take(inputs: Mapping, rows: int, index, width: int | None = None) -> dict:
    """Rows `index` of every per-row tensor, its columns cut to `width` where given (2-D ones of the batch's)."""
    full = _width(inputs)
    piece = {}
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == rows:
            value = value[index]
            if width is not None and value.dim() == 2 and value.shape[1] == full:
                value = value[:, :width].contiguous()  # (as a collator's: a model may `.view` it)
        piece[key] = value
    return piece


def _width(inputs: Mapping) -> int | None:
    mask = inputs.get("attention_mask")
    return int(mask.shape[1]) if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None


def _concat(parts: list):
    """The pieces' outputs (tensors, or nested tuples, lists, dicts of them) concatenated along the rows."""
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return torch.cat(parts, dim=0)
    if isinstance(first, (tuple, list)):
        return type(first)(_concat([part[i] for part in parts]) for i in range(len(first)))
    if isinstance(first, dict):
        return {key: _concat([part[key] for part in parts]) for key in first}
    raise TypeError(f"An eval output of type {type(first).__name__} cannot be put back together from pieces.")
