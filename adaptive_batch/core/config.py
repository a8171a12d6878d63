"""What the user can ask of AdaptiveBatch, checked when it is constructed. Pure Python."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from .goodput import NoiseScaleSchedule
from .lr import LRRule, gain_power, resolve_rule
from .noise import PRECONDITIONERS
from .schedule import Schedule, as_schedule, describe


@dataclass
class AdaptiveBatchConfig:
    schedule: Any = field(
        default=None,
        metadata={
            "help": "Effective batch (samples per optimizer step, all devices): None keeps the Trainer's "
            "per_device_train_batch_size x gradient_accumulation_steps x world size; an int; a PhaseSchedule; or "
            "any callable Progress -> int."
        },
    )
    micro_batch_size: int | str = field(
        default="auto",
        metadata={
            "help": "Samples per forward/backward on one device: 'auto' starts at per_device_train_batch_size and "
            "doubles while tokens/s improve by growth_margin; an int keeps that size. Both shrink on OOM."
        },
    )
    max_micro_batch_size: int | None = field(
        default=None, metadata={"help": "Never put more samples than this in one micro-batch."}
    )
    max_tokens_per_micro_batch: int | None = field(
        default=None,
        metadata={
            "help": "Cut each step by padded tokens (rows x padded length) instead, into micro-batches of at most "
            "this many tokens (a longer row runs alone) at the least time: micro_batch_overhead x micro-batches + "
            "padded tokens. An int micro_batch_size then caps the rows per micro-batch. Halves on OOM. None with "
            "micro_batch_size='auto' on rows of varying length: a budget that grows while memory allows."
        },
    )
    micro_batch_overhead: int | None = field(
        default=None,
        metadata={
            "help": "For cuts by tokens: the fixed time of one micro-batch, in padded tokens' worth. None measures "
            "it over the first steps; a stated value makes the cut depend on the rows' lengths alone."
        },
    )
    padding_free: bool = field(
        default=False,
        metadata={
            "help": "Run a padding collator's rows padding-free: each step flattened into one row of sequences "
            "(position_ids restarting, no attention_mask), cut between sequences. Needs right padding and an "
            "attention that keeps packed sequences apart (eager, sdpa, flex, flash). Same loss terms, no padding."
        },
    )
    lr_scaling: str | LRRule = field(
        default="none",
        metadata={
            "help": "How the learning rate follows the effective batch: 'none', 'sqrt' (Adam family), 'linear' "
            "(SGD), a callable (effective, starting) -> multiplier, or with a NoiseScaleSchedule 'gain' (SGD) or "
            "'sqrt_gain' (Adam family): AdaScale's gain from the noise scale at each change."
        },
    )
    growth_margin: float = field(
        default=0.01, metadata={"help": "Relative tokens/s gain a doubled micro-batch must bring to be kept."}
    )
    memory_headroom: float = field(
        default=0.10,
        metadata={"help": "Share of device memory 'auto' keeps free when predicting whether a size fits."},
    )
    measure_noise: bool = field(
        default=True,
        metadata={
            "help": "Measure the gradient noise scale from the micro-batches of every step that has 2 or more (on "
            "all ranks together), and log it. Training is unchanged either way."
        },
    )
    noise_time_constant_samples: float = field(
        default=4096,
        metadata={
            "help": "The noise scale's averages forget with exp(-samples / this): a step of b samples keeps "
            "exp(-b / tau) of the past, so about 2 tau / b steps count."
        },
    )
    noise_preconditioner: str = field(
        default="none",
        metadata={
            "help": "'none': the noise scale of the raw gradients; 'adam': of the gradients divided element-wise "
            "by Adam's sqrt(v_hat) + eps, read from the optimizer's exp_avg_sq (torch's Adam, AdamW)."
        },
    )

    def __post_init__(self):
        if self.schedule is not None:
            self.schedule = as_schedule(self.schedule)
        if self.micro_batch_size != "auto" and not _positive_int(self.micro_batch_size):
            raise ValueError(
                f"micro_batch_size={self.micro_batch_size!r} must be 'auto' or a positive int, e.g. "
                "micro_batch_size=8."
            )
        if self.max_micro_batch_size is not None and not _positive_int(self.max_micro_batch_size):
            raise ValueError(
                f"max_micro_batch_size={self.max_micro_batch_size!r} must be a positive int or None, e.g. 64."
            )
        if (
            _positive_int(self.micro_batch_size)
            and self.max_micro_batch_size is not None
            and self.micro_batch_size > self.max_micro_batch_size
        ):
            raise ValueError(
                f"micro_batch_size={self.micro_batch_size} exceeds max_micro_batch_size={self.max_micro_batch_size};"
                f" use micro_batch_size<={self.max_micro_batch_size}."
            )
        if self.max_tokens_per_micro_batch is not None and not _positive_int(self.max_tokens_per_micro_batch):
            raise ValueError(
                f"max_tokens_per_micro_batch={self.max_tokens_per_micro_batch!r} must be a positive int (padded "
                "tokens per micro-batch) or None, e.g. 16384: adaptive-batch probe's recommended size x seq_len."
            )
        if self.micro_batch_overhead is not None and not (
            isinstance(self.micro_batch_overhead, numbers.Integral)
            and not isinstance(self.micro_batch_overhead, bool)
            and self.micro_batch_overhead >= 0
        ):
            raise ValueError(
                f"micro_batch_overhead={self.micro_batch_overhead!r} must be an int >= 0 (padded tokens' worth of "
                "time per micro-batch) or None to measure it, e.g. 1024."
            )
        if not isinstance(self.padding_free, bool):
            raise ValueError(f"padding_free={self.padding_free!r} must be True or False.")
        self.rule = resolve_rule(self.lr_scaling)
        if gain_power(self.lr_scaling) is not None and not isinstance(self.schedule, NoiseScaleSchedule):
            given = "the Trainer's" if self.schedule is None else describe(self.schedule)
            raise ValueError(
                f"lr_scaling={self.lr_scaling!r} takes AdaScale's gain from the noise scale at each change of a "
                f"NoiseScaleSchedule, and the schedule is {given}. Use schedule=NoiseScaleSchedule(...), or "
                "lr_scaling='sqrt' (Adam family) or 'linear' (SGD)."
            )
        if not isinstance(self.growth_margin, numbers.Real) or not 0 <= self.growth_margin < 1:
            raise ValueError(f"growth_margin={self.growth_margin!r} must be in [0, 1), e.g. 0.02 for 2%.")
        if not isinstance(self.memory_headroom, numbers.Real) or not 0 <= self.memory_headroom < 1:
            raise ValueError(f"memory_headroom={self.memory_headroom!r} must be in [0, 1), e.g. 0.1 for 10%.")
        self._check_noise()

    def _check_noise(self) -> None:
        if not isinstance(self.measure_noise, bool):
            raise ValueError(f"measure_noise={self.measure_noise!r} must be True or False.")
        tau = self.noise_time_constant_samples
        if not (
            isinstance(tau, numbers.Real) and not isinstance(tau, bool) and 0 < tau and math.isfinite(tau)
        ):
            raise ValueError(
                f"noise_time_constant_samples={tau!r} must be a positive, finite number of samples (the noise "
                "scale's averages forget with exp(-samples / it)), e.g. 4096, or about 50 steps' samples."
            )
        if self.noise_preconditioner not in PRECONDITIONERS:
            raise ValueError(
                f"noise_preconditioner={self.noise_preconditioner!r} must be one of 'none' (raw gradients) or "
                "'adam' (gradients divided by Adam's second moments), e.g. noise_preconditioner='adam'."
            )

    @property
    def auto(self) -> bool:
        return self.micro_batch_size == "auto"

    def resolved_schedule(self, default_effective_batch_size: int) -> Schedule:
        return self.schedule if self.schedule is not None else as_schedule(default_effective_batch_size)


def _positive_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1
