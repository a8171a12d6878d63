"""What the choice of a controller reads of a Trainer ([`core.controllers.RunFacts`]), each read on first use."""

from __future__ import annotations

import logging
from functools import cached_property, partial

from ..core import traps
from ..core.config import AdaptiveBatchConfig
from ..core.controllers import Layout, choose_layout
from ..probe.cache import cached_start, describe_setup
from ..runtime import lengths
from ..runtime.compat.trainer import attention_implementation, causal_rows, padding_free
from ..runtime.engines import Engine
from ..runtime.memory import memory_limit

logger = logging.getLogger("adaptive_batch")


class TrainerFacts:
    """[`core.controllers.RunFacts`] of one Trainer, for one plan."""

    def __init__(self, trainer, config: AdaptiveBatchConfig, engine: Engine, shown=None):
        """`shown(layout, positions)`: what a check on the model showed for a layout ([`core.controllers.choose_layout`])."""
        self.trainer, self.config, self.shown = trainer, config, shown
        self.oom_is_fatal = not engine.retries

    @cached_property
    def lengths_vary(self) -> bool | None:
        row_lengths = lengths.row_lengths(self.trainer.train_dataset)
        return None if row_lengths is None else min(row_lengths) != max(row_lengths)

    def observe(self, lengths_vary: bool, longest_row: int) -> None:
        self.__dict__.pop("layout", None)  # (chosen again from the lengths observed)
        self.lengths_vary = lengths_vary
        max_length = getattr(self.trainer.args, "max_length", None)
        self.longest_row = min(longest_row, max_length) if max_length else longest_row

    @cached_property
    def layout(self) -> Layout:
        return choose_layout(
            self.config.padding_free,
            padding_free(self.trainer),
            attention_implementation(self.trainer.model),
            self.lengths_vary,
            self.causal_rows[0],
            shown=partial(self.shown, positions=self.causal_rows[1]) if self.shown else None,
        )

    @cached_property
    def causal_rows(self) -> tuple[bool, bool]:
        """[`compat.trainer.causal_rows`]: whether padded rows may leave their mask out, and give `position_ids`."""
        return causal_rows(self.trainer)

    @property
    def padding_free(self) -> bool:
        return padding_free(self.trainer) or self.layout.flatten

    @cached_property
    def longest_row(self) -> int:
        """The longest row, at most TRL's `max_length` (it truncates to it)."""
        longest = lengths.longest(self.trainer.train_dataset)
        max_length = getattr(self.trainer.args, "max_length", None)
        return min(longest, max_length) if max_length else longest

    @cached_property
    def packed_row_tokens(self) -> int | None:
        args = self.trainer.args
        return getattr(args, "max_length", None) if getattr(args, "packing", False) else None

    @cached_property
    def memory_limit(self) -> float | None:
        return memory_limit(self.trainer.args.device, self.config.memory_headroom)

    @cached_property
    def probed(self):
        trainer, args = self.trainer, self.trainer.args
        seq_len = getattr(args, "max_length", None) or lengths.longest(trainer.train_dataset)
        if seq_len is None or not hasattr(trainer.model, "config"):
            return None
        setup = describe_setup(trainer.model, args.optim, bool(args.gradient_checkpointing))
        return cached_start(setup, seq_len)

    @cached_property
    def start(self) -> int:
        probed, per_device = self.probed, self.trainer.args.per_device_train_batch_size
        if probed is None:
            return per_device
        if probed.message is not None:
            logger.info("%s", probed.message)
        return probed.size if probed.size is not None else per_device

    def probed_traps(self) -> list[str]:
        probed = self.probed
        if probed is None or probed.seq_len is None:
            return []
        config, args = self.config, self.trainer.args
        return traps.probed_traps(config.micro_batch_size, args.per_device_eval_batch_size, probed)
