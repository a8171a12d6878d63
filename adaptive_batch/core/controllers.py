"""Which controller cuts a run's steps, and in which unit: the one place that chooses.

- A stated `max_tokens_per_micro_batch`: by padded tokens, with that budget ([`tokens.TokenController`]).
- `"auto"` on rows known to vary in length, padded by the collator: by padded tokens too, with a budget that starts
  at the starting size x the longest row and grows (a micro-batch counted in rows would be padded to its longest
  row and sized by the longest rows' memory).
- Otherwise by rows ([`rows.RowController`]): rows of one length, lengths that cannot be read before training, and
  padding-free sequences (with sdpa a larger packed micro-batch can be slower, its mask being quadratic in all its
  tokens, so their sizes are chosen by measured speed). Rows are the dataset's: where TRL's packing puts several
  sequences in each row and the collator flattens a step into one row of them, a micro-batch of `n` rows is a run
  of whole sequences of at most `n x max_length` tokens, so that `per_device_train_batch_size`, `micro_batch_size`
  and `max_micro_batch_size` all count packed rows, and a step the plain Trainer runs as one forward starts as one.

Pure Python: no torch, no transformers.
"""

from __future__ import annotations

from typing import Protocol

from .config import AdaptiveBatchConfig
from .microbatch import CutController
from .rows import RowController
from .tokens import TokenController


class RunFacts(Protocol):
    """What the choice reads of the run. The Trainer wiring computes each on first use (reading the probe's cache,
    or a dataset's lengths, costs time and may log a line)."""

    lengths_vary: bool | None  # the dataset's rows differ in length; None: not known before training
    padding_free: bool  # the collator flattens each batch into one row of sequences (or padding_free=True)
    start: int  # where "auto" starts: a probed size for this setup, else the per-device batch
    longest_row: int  # tokens of the dataset's longest row (at most max_length)
    memory_limit: float | None  # bytes a micro-batch's peak may reach (None: unknown, as on the CPU)
    oom_is_fatal: bool  # an out-of-memory error cannot be retried (several processes under ZeRO or FSDP2)
    packed_row_tokens: (
        int | None
    )  # tokens of a packed row (TRL's packing: its max_length); None: rows are not packed


def controller_for(config: AdaptiveBatchConfig, facts: RunFacts, row_limit: int) -> CutController:
    """The controller for a run (`row_limit`: the most rows a step holds on a rank, from the plan)."""
    budget = config.max_tokens_per_micro_batch
    tune = budget is None and config.auto and facts.lengths_vary and not facts.padding_free
    if tune:
        budget = facts.start * facts.longest_row
    if budget is not None:
        return TokenController(
            budget,
            max_rows=stated_max_rows(config),
            row_limit=row_limit,
            tune=tune,
            overhead=config.micro_batch_overhead,
            memory_limit=facts.memory_limit,
            oom_is_fatal=facts.oom_is_fatal,
        )
    return RowController(
        facts.start if config.auto else config.micro_batch_size,
        auto=config.auto,
        max_size=config.max_micro_batch_size,
        row_limit=row_limit,
        growth_margin=config.growth_margin,
        memory_limit=facts.memory_limit,
        oom_is_fatal=facts.oom_is_fatal,
        row_tokens=facts.packed_row_tokens,
    )


def waits_for_lengths(config: AdaptiveBatchConfig, facts: RunFacts) -> bool:
    """Whether the choice waits for the first step: "auto" over a dataset that cannot tell its rows' lengths
    before training (a torch `Dataset`, a transform, a stream), padded by the collator. Until then steps are cut by
    rows; the first step's lengths decide, as the dataset's would have."""
    return (
        config.auto
        and config.max_tokens_per_micro_batch is None
        and facts.lengths_vary is None
        and not facts.padding_free
    )


def stated_max_rows(config: AdaptiveBatchConfig) -> int | None:
    """The most rows a micro-batch cut by tokens may hold, as stated: `max_micro_batch_size`, and an `int`
    `micro_batch_size` (which caps the rows there)."""
    caps = [config.max_micro_batch_size, None if config.auto else config.micro_batch_size]
    caps = [cap for cap in caps if cap is not None]
    return min(caps) if caps else None
