"""What the user can ask of AdaptiveBatch: every setting, its default and its help, checked when constructed, and
read by `AdaptiveBatch`'s signature and docstring, the command line and checkpoints. Pure Python."""

from __future__ import annotations

import difflib
import inspect
import numbers
import os
import textwrap
from dataclasses import dataclass, field, fields
from typing import Any

from .goodput import NoiseScaleSchedule
from .lr import LRRule, gain_power, resolve_rule
from .noise import PRECONDITIONERS
from .schedule import Schedule, as_schedule, describe, finite_number


def setting(default, help: str, micro_batch: bool = False, meaning: str | None = None):
    """A field of [`AdaptiveBatchConfig`]; `micro_batch`: it decides how steps are cut (a checkpoint records it);
    `meaning`: the help without the Python values, for a command-line option that spells its values otherwise."""
    return field(default=default, metadata={"help": help, "micro_batch": micro_batch, "meaning": meaning})


@dataclass
class AdaptiveBatchConfig:
    schedule: Any = setting(
        None,
        "The effective batch over training (samples per optimizer step, all GPUs): `None` keeps the Trainer's "
        "`per_device_train_batch_size x gradient_accumulation_steps x world size`; an `int`; a `PhaseSchedule` "
        "(e.g. a batch-size warmup 8 -> 16 -> 32, boundaries in a fraction of the budget, samples or steps); a "
        "`NoiseScaleSchedule`, which grows it where the measured gradient noise scale says it pays; or any "
        "callable `Progress(step, samples_seen, fraction) -> int`.",
        meaning="The effective batch over training (samples per optimizer step, all GPUs)",
    )
    micro_batch_size: int | str = setting(
        "auto",
        "Samples per forward/backward on one GPU: `'auto'` starts at `per_device_train_batch_size` (or a size "
        "`adaptive-batch probe` cached for this setup) and doubles while tokens/s improve by `growth_margin` (or "
        "halves while they do, where the first doubling does not); on "
        "rows whose lengths vary (read from the dataset's `input_ids`) it cuts each step by padded tokens instead, "
        "with a budget that starts at that size x the longest row and doubles while the cut needs more and memory "
        "allows. An `int` keeps that size (and caps the rows of a cut by tokens). Both shrink and retry the step "
        "on out-of-memory.",
        micro_batch=True,
    )
    max_micro_batch_size: int | None = setting(
        None, "Never put more samples than this in one micro-batch.", micro_batch=True
    )
    max_tokens_per_micro_batch: int | None = setting(
        None,
        "Cut each step by padded tokens (rows x the length they are padded to, longest rows first) into "
        "micro-batches of at most this many tokens (a longer row runs alone) at the least modelled time, "
        "`micro_batch_overhead` x micro-batches + padded tokens; nothing grows. Take it from `adaptive-batch "
        "probe` at your max_length (`boundary_tokens`). An out-of-memory error halves it.",
        micro_batch=True,
    )
    micro_batch_overhead: int | None = setting(
        None,
        "For cuts by tokens: the fixed time of one micro-batch, in padded tokens' worth. `None` measures it over "
        "the first steps (a robust line of time against padded tokens); a stated value makes the cut depend on "
        "the rows' lengths alone from the first step.",
        micro_batch=True,
    )
    padding_free: bool | None = setting(
        None,
        "Run a padding collator's rows padding-free: each step batch flattened into one row of sequences "
        "(`position_ids` restarting at each, no `attention_mask`, each row's first label ignored) and cut between "
        "sequences. The loss terms are the padded batch's; no padding is computed. `None` chooses: padding-free on "
        "rows of varying length where the model's attention reads packed sequences at no cost beyond their tokens "
        "(flex and flash attention), the padded cut by tokens under sdpa and eager (their mask for a flattened "
        "step is quadratic in all its tokens). `True` also under sdpa and eager (right padding needed); `False` "
        "keeps the padded cut.",
        micro_batch=True,
    )
    lr_scaling: str | LRRule = setting(
        "none",
        "How the learning rate follows the effective batch, relative to the starting one, on top of your "
        "scheduler: `'none'`, `'sqrt'` (Adam family), `'linear'` (SGD), a callable `(effective, starting) -> "
        "multiplier`, or with a `NoiseScaleSchedule` `'gain'` (SGD) or `'sqrt_gain'` (Adam family): AdaScale's "
        "gain (B / B0)(B_noise + B0) / (B_noise + B), or its square root, B_noise measured at each change.",
        meaning="How the learning rate follows the effective batch, relative to the starting one, on top of your "
        "scheduler",
    )
    growth_margin: float = setting(0.01, "The tokens/s gain a doubled micro-batch must bring to be kept.")
    memory_headroom: float = setting(
        0.10, "The share of GPU memory `'auto'` keeps free when it predicts whether a size fits."
    )
    adapt_evaluation: bool | str = setting(
        True,
        "Evaluation and prediction survive an out-of-memory error: the eval batch runs again in pieces of half its "
        "rows, put back together as the whole batch's (the same loss, logits and labels), and later batches start "
        "at the size that ran; `eval_adaptive_batch/micro_batch_size` logs the largest piece. Not under DeepSpeed "
        "or FSDP. `'grow'`: also double `per_device_eval_batch_size` from one evaluation to the next while the "
        "eval set's rows/s rise by `growth_margin` and the doubled batch's predicted memory fits (the eval loss is "
        "then the Trainer's mean over the larger batches: the same on rows of one length, not on ragged rows). "
        "`False`: the Trainer's own evaluation.",
    )
    measure_noise: bool = setting(
        True,
        "Measure the gradient noise scale (McCandlish et al. 2018) on every step of 2 or more micro-batches (all "
        "GPUs together), from one norm of each micro-batch's gradient read before it is added into `.grad`; "
        "training is unchanged either way.",
    )
    noise_time_constant_samples: float = setting(
        4096,
        "The noise scale's averages forget with exp(-samples / this): a step of b samples keeps exp(-b / tau) of "
        "the past, so about 2 tau / b steps count.",
    )
    noise_preconditioner: str = setting(
        "none",
        "`'none'`: the noise scale of the raw gradients; `'adam'`: of the gradients divided by Adam's sqrt(v_hat) "
        "+ eps, read from the optimizer's `exp_avg_sq` (torch's Adam, AdamW; unmeasured until the first optimizer "
        "step). Beware with a language model from scratch: embedding rows of tokens not seen yet have v = 0, are "
        "divided by eps and can dominate the estimate.",
    )

    replay: str | None = setting(
        None,
        "Make this run bit for bit an earlier run of the same script on the same machine: the path of the "
        "`adaptive_batch_measurements.json` every run writes into its `output_dir` (and each checkpoint folder), or "
        "that folder. Every decision that follows measured time or memory (the micro-batch search, the token cut, "
        "a `NoiseScaleSchedule`'s changes, the eval batch under `'grow'`) then reads the recorded run's "
        "measurements instead of the clock, and a recorded out-of-memory error is replayed. A record of another "
        "run (dataset, plan, world size or settings) is refused before any compute; an out-of-memory error the "
        "record does not hold ends the replay there, with a warning, and the run goes on measuring for itself.",
    )

    @classmethod
    def from_settings(cls, **settings) -> AdaptiveBatchConfig:
        """The config of `AdaptiveBatch(**settings)`; an unknown name is refused with the nearest known one."""
        names = [f.name for f in fields(cls)]
        for name in settings:
            if name not in names:
                near = difflib.get_close_matches(name, names, n=1)
                hint = f" Did you mean {near[0]}?" if near else ""
                raise TypeError(
                    f"AdaptiveBatch has no setting {name!r}.{hint} Its settings: {', '.join(names)}."
                )
        return cls(**settings)

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
        largest = self.max_micro_batch_size
        if _positive_int(self.micro_batch_size) and largest is not None and self.micro_batch_size > largest:
            raise ValueError(
                f"micro_batch_size={self.micro_batch_size} exceeds max_micro_batch_size={self.max_micro_batch_size};"
                f" use micro_batch_size<={self.max_micro_batch_size}."
            )
        if self.max_tokens_per_micro_batch is not None and not _positive_int(self.max_tokens_per_micro_batch):
            raise ValueError(
                f"max_tokens_per_micro_batch={self.max_tokens_per_micro_batch!r} must be a positive int (padded "
                "tokens per micro-batch) or None, e.g. 16384: adaptive-batch probe's recommended size x seq_len."
            )
        if self.micro_batch_overhead is not None and not _positive_int(self.micro_batch_overhead, least=0):
            raise ValueError(
                f"micro_batch_overhead={self.micro_batch_overhead!r} must be an int >= 0 (padded tokens' worth of "
                "time per micro-batch) or None to measure it, e.g. 1024."
            )
        if self.padding_free is not None and not isinstance(self.padding_free, bool):
            raise ValueError(
                f"padding_free={self.padding_free!r} must be True, False or None (None: chosen from the attention)."
            )
        if not (isinstance(self.adapt_evaluation, bool) or self.adapt_evaluation == "grow"):
            raise ValueError(
                f"adapt_evaluation={self.adapt_evaluation!r} must be True (evaluation survives an out-of-memory "
                "error), 'grow' (and its batch grows while it pays) or False (the Trainer's own), e.g. "
                "adapt_evaluation='grow'."
            )
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
        if not isinstance(self.measure_noise, bool):
            raise ValueError(f"measure_noise={self.measure_noise!r} must be True or False.")
        tau = self.noise_time_constant_samples
        if not (finite_number(tau) and tau > 0):
            raise ValueError(
                f"noise_time_constant_samples={tau!r} must be a positive, finite number of samples (the noise "
                "scale's averages forget with exp(-samples / it)), e.g. 4096, or about 50 steps' samples."
            )
        if self.noise_preconditioner not in PRECONDITIONERS:
            raise ValueError(
                f"noise_preconditioner={self.noise_preconditioner!r} must be one of 'none' (raw gradients) or "
                "'adam' (gradients divided by Adam's second moments), e.g. noise_preconditioner='adam'."
            )
        if self.replay is not None and not (isinstance(self.replay, (str, os.PathLike)) and str(self.replay)):
            raise ValueError(
                f"replay={self.replay!r} must be the path of a run's adaptive_batch_measurements.json (or the folder "
                "holding it), or None, e.g. replay='out/adaptive_batch_measurements.json'."
            )
        if self.replay is not None:
            self.replay = os.fspath(self.replay)

    @property
    def auto(self) -> bool:
        return self.micro_batch_size == "auto"

    def resolved_schedule(self, default_effective_batch_size: int) -> Schedule:
        return self.schedule if self.schedule is not None else as_schedule(default_effective_batch_size)

    def micro_batch_settings(self) -> dict:
        """The settings that decide how steps are cut, as plain JSON (what a checkpoint records)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata["micro_batch"]}


def meaning(name: str) -> str:
    """What one setting is, without the Python values it takes (its help where it states no separate meaning)."""
    f = next(f for f in fields(AdaptiveBatchConfig) if f.name == name)
    return f.metadata["meaning"] or f.metadata["help"]


def settings_doc(indent: int = 8) -> str:
    """Every setting as a docstring's `Args:` entries (`name: help`), wrapped and indented."""
    first, rest = " " * indent, " " * (indent + 4)
    entries = (f"{f.name}: {f.metadata['help']} Default: {f.default!r}." for f in fields(AdaptiveBatchConfig))
    return "\n".join(
        textwrap.fill(entry, 110, initial_indent=first, subsequent_indent=rest) for entry in entries
    )


def settings_signature() -> inspect.Signature:
    """The signature `AdaptiveBatch(schedule=None, micro_batch_size='auto', ...)`, from the fields."""
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for index, f in enumerate(fields(AdaptiveBatchConfig)):
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if index == 0 else inspect.Parameter.KEYWORD_ONLY
        parameters.append(inspect.Parameter(f.name, kind, default=f.default))
    return inspect.Signature(parameters)


def _positive_int(value, least: int = 1) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= least
