"""One optimizer step as micro-batches through the user's own `training_step`, out-of-memory errors survived. See
docs/how-it-works.md, "Data, cuts and measurements" (3. Micro-batches) and "Several processes"."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from ..core.microbatch import CutController, MicroBatch, MicroBatchTooLargeError, StepMemory
from ..core.noise import MicroBatchSums
from ..core.replay import Tape
from .batch import StepBatch, is_packed
from .compat.trainer import loss_normalised_over_ranks, loss_shifts_labels, pad_to_multiple_of
from .compat.trl import TrlMetrics
from .engines import Engine
from .memory import Stopwatch, alloc_retries, peak_allocated, release_memory, reset_peak
from .noise_hooks import GradientNoiseMeter
from .packed import PackedStepBatch, check_packed_inputs, flatten_padded, flattened, why_not_flat
from .ranks import Ranks, Report

logger = logging.getLogger(__name__)

InnerStep = Callable[[torch.nn.Module, dict, object], torch.Tensor]


@dataclass
class StepNoise:
    """The last step's noise measurement, unscaled: the micro-batches' sums (all ranks) and S_big, |G_step|^2."""

    sums: MicroBatchSums
    step_norm_sq: float


@dataclass
class StepStats:
    """What the last step did, for the logs."""

    micro_batch_size: int = 0
    accumulation_steps: int = 0
    real_tokens: int = 0
    retries: int = 0
    noise: StepNoise | None = None  # `None` when not measured (off, one micro-batch, or skipped)


class MicroBatchRunner:
    """Runs optimizer steps as micro-batches for one Trainer, cut by `controller` (`noise`: `None` for off)."""

    def __init__(
        self,
        trainer,
        controller: CutController,
        world_size: int,
        engine: Engine,
        packed: bool = False,
        flatten: bool = False,
        in_rows: bool = False,
        flatten_stated: bool = False,
        noise: GradientNoiseMeter | None = None,
        unmasked: tuple[bool, bool] = (False, False),
    ):
        self.trainer, self.controller, self.world_size, self.engine = trainer, controller, world_size, engine
        self.ranks = Ranks(trainer, world_size)
        self.packed = packed  # the collator flattens every batch (a step of one sequence looks unpacked)
        # in_rows: each flattened micro-batch packed into rows (sdpa, eager); flatten_stated: padding_free=True
        self.flatten, self.in_rows, self.flatten_stated = flatten, in_rows, flatten_stated
        self.refusal_logged = False
        # padded rows without their mask where exact; with `position_ids` in its place
        self.unmasked = unmasked
        self.device = trainer.args.device
        self.noise = noise  # None where the engine cannot measure it (the session says so)
        # whether the model's loss scores position i against label i + 1, as shown on it (`None`: the Trainer's
        # reading, which assumes it of every causal LM's loss, BartForCausalLM's too)
        self.shifts_labels: bool | None = None
        self.align = pad_to_multiple_of(trainer)  # trimmed micro-batches keep the collator's alignment
        self.trims = True  # micro-batches cut short of trailing padding (a check on the model may say not)
        self.tape = Tape()  # what decisions read of time and memory: measured, or replayed (the session's)
        self.last = StepStats()

    def follow_model(self, shifts_labels: bool | None, trims: bool) -> None:
        """What checks on the model showed: whether its loss scores label i + 1 at position i (`None`: not told, the
        Trainer's reading), and whether a micro-batch may be cut short of its trailing padding."""
        self.shifts_labels, self.trims = shifts_labels, trims

    def run(
        self, inner_step: InnerStep, model, inputs: dict, num_items_in_batch, max_rows: int, split: bool
    ) -> torch.Tensor:
        """Forward and backward of this rank's share of a step batch through the user's `training_step`; returns
        the detached loss. `split`: at least two micro-batches (so that one process measures the noise)."""
        flatten = self.flatten and not is_packed(inputs)
        if flatten and self.flatten_stated:
            inputs = flatten_padded(inputs)  # (refuses a batch it cannot flatten exactly, saying why)
        elif flatten:
            # a layout chosen, not asked for: a step batch that cannot be flattened exactly (left padding, labels on
            # padding, a per-row input; on any rank) runs padded, as the plain Trainer's
            why = why_not_flat(inputs)
            flatten = not self.ranks.max([float(why is not None)])[0]
            if not (flatten or self.refusal_logged):
                self.refusal_logged = True
                logger.warning("AdaptiveBatch: steps run padded: %s.", why or "so on another rank")
            inputs = flattened(inputs) if flatten else inputs
        packed = self.packed or flatten or is_packed(inputs)
        if not (self.packed or self.flatten):
            # a collator not known to flatten: a rank whose flattened row holds one sequence cannot tell
            packed = bool(self.ranks.max([float(packed)])[0])
        rows = flatten and self.in_rows
        batch = (
            PackedStepBatch(inputs, rows)
            if packed
            else StepBatch(inputs, *self.unmasked, self.align, self.trims)
        )
        if packed:  # its sequences are the rows, as many as the collator packed on each rank
            check_packed_inputs(inputs, model)
            max_rows = int(self.ranks.max([batch.rows])[0])
        elif batch.rows not in (max_rows, max_rows - 1):
            raise RuntimeError(f"Step batch of {batch.rows} rows where the plan gives {max_rows} per rank.")
        shifts = self.shifts_labels if self.shifts_labels is not None else loss_shifts_labels(self.trainer)
        counts = batch.label_counts(shifts)
        step = _Step(inner_step, model, batch, num_items_in_batch, counts)
        if self.noise is not None:
            step.share_total = self._share_total(step)
            self.noise.begin_step(model, self.trainer.optimizer)
        metrics = TrlMetrics(self.trainer)
        was_exploring = self.controller.exploring
        retries, row_cap = 0, math.ceil(max_rows / 2) if split and max_rows > 1 else None
        while True:
            outcome = self._attempt(step, max_rows, row_cap, retries)
            if outcome.failed is None:
                break
            retries += 1
            # undo the attempt: gradients back to none (as at a step's start), TRL metrics back, memory freed
            self.engine.forget(model, self.trainer.optimizer)
            metrics.restore()
            release_memory(self.device)
            failed = outcome.failed
            try:
                self.controller.on_out_of_memory(failed.failed_rows, failed.failed_tokens)
            except MicroBatchTooLargeError as error:
                length = f" of {batch.seq_len} tokens" if batch.seq_len else ""
                message = (
                    f"One sample per micro-batch{length} does not fit in memory on {self.device}, so no micro-batch "
                    "size can run this step. Free memory per sample: enable gradient_checkpointing=True, load the "
                    "base model in 4-bit (QLoRA), use an 8-bit or paged optimizer (optim='paged_adamw_8bit'), or "
                    "lower max_length."
                )
                raise MicroBatchTooLargeError(message, error.tried) from None
            logger.warning("%s", self.controller.retry_message(failed.failed_rows, failed.failed_tokens))
        real_tokens = batch.real_tokens()
        sums = (
            self.noise.step_sums(self.ranks.count, self.ranks.distributed) if self.noise else MicroBatchSums()
        )
        self.engine.finish_step(model)
        if self.ranks.distributed:  # the noise sums travel with the token count: no collective of their own
            totals = self.ranks.sum([real_tokens, *sums.to_list()])
            real_tokens, sums = int(totals[0]), MicroBatchSums.from_list(totals[1:])
        metrics.correct(real_tokens)
        self.last = StepStats(outcome.largest, outcome.chunks, real_tokens, retries, self._step_noise(sums))
        if was_exploring and not self.controller.exploring:
            # the search is over: give back the cache that trial sizes larger than the chosen one made grow (the CPU
            # keeps none, and a collection there would only cost time)
            release_memory(self.device, collect=self.device.type != "cpu")
            logger.info("AdaptiveBatch settled: %s.", self.controller.settled_because)
        return outcome.loss

    def _attempt(self, step: _Step, max_rows: int, row_cap: int | None = None, attempt: int = 0) -> _Outcome:
        """Run the controller's cut of the step; stop at the first micro-batch that ran out of memory on any rank."""
        cut = self.controller.cut(step.batch, max_rows, self.ranks.max, row_cap)
        outcome = _Outcome(loss=torch.zeros((), device=self.device))
        if self.noise is not None:
            self.noise.begin_attempt()
        retries_before = alloc_retries(self.device)
        reset_peak(self.device)
        for index, micro in enumerate(cut):
            report = self._micro_batch(step, micro, outcome, f"{attempt}.{index}")
            if report.out_of_memory:
                report.failed_rows = cut.failed_rows(micro, report)
                outcome.failed = report
                return outcome
            cut.record(micro, report)
            outcome.chunks += 1
            outcome.largest = max(outcome.largest, micro.size)
            tokens = step.batch.padded_tokens(micro.start, micro.rows)
            outcome.largest_tokens = max(outcome.largest_tokens, tokens)
            if report.measured_peak is not None:
                outcome.peak = max(outcome.peak, report.measured_peak)
        notice = cut.finish(self._step_memory(outcome, retries_before, attempt))
        if notice is not None:
            logger.warning("AdaptiveBatch: %s", notice)
        return outcome

    def _step_memory(self, outcome: _Outcome, retries_before: int, attempt: int = 0) -> StepMemory:
        """What the step's end tells the controller about memory, the same on every rank (their largest)."""
        peak = peak_allocated(self.device)  # (`None` where not measured: the CPU)
        thrashed = peak is not None and alloc_retries(self.device) > retries_before
        if peak is not None:
            peak, thrashed = self.tape.measure("train", self._step, f"memory {attempt}", [peak, thrashed])
        # (a timed micro-batch reset the peak when it began: the step's is the larger of the two)
        tokens, peak, thrashed = self.ranks.max(
            [outcome.largest_tokens, -1.0 if peak is None else max(peak, outcome.peak), float(thrashed)]
        )
        return StepMemory(outcome.largest, int(tokens), None if peak < 0 else peak, bool(thrashed))

    @property
    def _step(self) -> int:
        return self.trainer.state.global_step

    def close(self) -> None:
        if self.noise is not None:
            self.noise.remove()

    def _share_total(self, step: _Step) -> float:
        """What a micro-batch's units are divided by to give its share of the step gradient."""
        if self.ranks.distributed and step.num_items is not None and loss_normalised_over_ranks(self.trainer):
            return float(step.num_items)
        return self.ranks.count * step.total()

    def _step_noise(self, sums: MicroBatchSums) -> StepNoise | None:
        """The step's noise measurement, unscaled (`None` if there is nothing to estimate)."""
        if self.noise is None or not sums.count >= 2:
            return None
        if not sums.complete:
            if math.isfinite(sums.shares):  # NaN: a rank could not measure, and said why
                self.noise.warn_once(
                    "shares",
                    f"The micro-batches' shares of the step gradient add up to {sums.shares:.6g}, not 1: the "
                    "label tokens AdaptiveBatch counts differ from the Trainer's num_items_in_batch, so the "
                    "gradient noise scale is not measured.",
                )
            return None
        # an fp16 GradScaler's factor is still in the gradients here
        scaler = getattr(self.trainer.accelerator, "scaler", None)
        scale_sq = float(scaler.get_scale()) ** 2 if scaler is not None and scaler.is_enabled() else 1.0
        sums.small /= scale_sq
        return StepNoise(sums, self.noise.step_norm_sq() / scale_sq)

    def _micro_batch(self, step: _Step, micro: MicroBatch, outcome: _Outcome, name: str) -> Report:
        """Forward and backward of the micro-batch, its loss added to `outcome`; the report the ranks agree on."""
        work = partial(self._forward_backward, step, micro, outcome, name)
        failed = partial(_failed, step.batch, micro.start, micro.rows)
        fatal = (
            None if self.engine.retries else partial(self.engine.out_of_memory, world_size=self.world_size)
        )
        return self.ranks.run(work, failed, self.tape, ("train", self._step, f"oom {name}"), fatal)

    def _forward_backward(self, step: _Step, micro: MicroBatch, outcome: _Outcome, name: str) -> Report:
        trainer, batch = self.trainer, step.batch
        start, own = micro.start, micro.rows
        stopwatch = Stopwatch(self.device) if micro.timed else None
        with stopwatch or contextlib.nullcontext(), self.engine.micro_batch(step.model, micro.last):
            if own > 0:
                chunk = batch.take(start, own)
                # the Trainer divides a loss computed without `num_items_in_batch` by this
                trainer.current_gradient_accumulation_steps = step.divisor(start, own)
                # rows without a label token add no gradient
                if self.noise is not None and (units := step.units(start, own)) > 0:
                    self.noise.begin_micro_batch(units, units / step.share_total)
            else:  # a rank with fewer rows: a row that adds nothing (a mean loss is divided by inf)
                chunk = batch.dummy(count_items=step.num_items is not None)
                trainer.current_gradient_accumulation_steps = float("inf")
            loss = step.inner_step(step.model, chunk, step.num_items)
            if own > 0 and self.noise is not None:
                self.noise.end_micro_batch()
            del chunk
        if own > 0:
            outcome.loss += loss.detach()
        del loss
        local = Report()
        if stopwatch is not None:
            readings = [stopwatch.seconds, stopwatch.peak_bytes]
            seconds, peak = self.tape.measure("train", self._step, f"micro {name}", readings)
            local.seconds = seconds
            local.peak_bytes = peak if peak is not None else -math.inf
            local.real_tokens, local.padded_tokens = batch.tokens(start, max(own, 1))
        return local


def _failed(batch: StepBatch, start: int, own: int) -> Report:
    """The report of a micro-batch that ran out of memory (a row that adds nothing, `own` 0, counts as one)."""
    first, rows = (start, own) if own else (batch.rows - 1, 1)
    return Report(True, failed_rows=rows, failed_tokens=batch.tokens(first, rows)[1])


@dataclass
class _Step:
    """What a step's micro-batches run `training_step` with, and its rows' label tokens (`None`: alike)."""

    inner_step: InnerStep
    model: torch.nn.Module
    batch: StepBatch | PackedStepBatch
    num_items: object
    counts: torch.Tensor | None
    share_total: float = math.nan  # a micro-batch's units over this are its share of the step gradient

    def units(self, start: int, size: int) -> float:
        if self.counts is None:
            return float(size)
        return float(self.counts[self.batch.order[start : start + size]].sum())

    def total(self) -> float:
        return float(self.batch.rows) if self.counts is None else float(self.counts.sum())

    def divisor(self, start: int, size: int) -> float:
        part = self.units(start, size)
        return self.total() / part if part > 0 else float("inf")


@dataclass
class _Outcome:
    loss: torch.Tensor
    chunks: int = 0
    largest: int = 0  # the largest micro-batch, in the controller's unit, and the most padded tokens one held
    largest_tokens: int = 0
    peak: float = 0.0  # the largest peak a timed micro-batch measured
    failed: Report | None = None  # the report of the micro-batch that ran out of memory on some rank
