"""Wiring into `transformers.Trainer` (and subclasses such as TRL's SFTTrainer).

The Trainer instance gets a subclass of its own class with a few methods overridden (`AdaptiveTrainerMixin`):

- `train`: reads the checkpoint to resume (if any) and plans the steps, then runs the Trainer's own loop with
  gradient accumulation 1;
- `get_train_dataloader`: one batch per optimizer step per rank, from a [`StepBatchSampler`];
- `set_initial_training_values`: the loop's step count, epochs and samples come from the plan;
- `create_scheduler`: the user's scheduler, built for the budget in steps of the starting batch, then driven by
  the sample clock and the LR rule;
- `training_step`: cuts the step batch into micro-batches, each through the user's class's `training_step`;
- `log`: adds the `adaptive_batch/*` metrics to every training log;
- `_load_callback_state`: keeps AdaptiveBatch's live callback (its state was read when `train` started).

Everything else (evaluation, checkpoints, callbacks, mixed precision, DDP wrapping) is the Trainer's own.
"""

from __future__ import annotations

import logging

from torch.utils.data import DataLoader
from transformers import Trainer

from ..core.checkpoint import STATE_KEY, read_checkpoint
from ..core.config import AdaptiveBatchConfig
from ..runtime.engines import prepare as prepare_engine
from .checks import check_trainer
from .session import Session

logger = logging.getLogger("adaptive_batch")


class AdaptiveTrainerMixin:
    """Placed in front of the user's Trainer class; see the module docstring."""

    _adaptive_batch: Session
    _adaptive_batch_mixin = True  # the methods here replace the Trainer's; `check_trainer` looks past them

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if isinstance(resume_from_checkpoint, bool) and resume_from_checkpoint:
            from transformers.trainer_utils import get_last_checkpoint

            # as the Trainer does; when none is found it raises its own error
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir) or True
        checkpoint = (
            read_checkpoint(resume_from_checkpoint) if isinstance(resume_from_checkpoint, str) else None
        )
        with self._adaptive_batch.training(checkpoint):
            return super().train(resume_from_checkpoint, *args, **kwargs)

    def get_train_dataloader(self) -> DataLoader:
        return self._adaptive_batch.train_dataloader()

    def set_initial_training_values(self, args, dataloader):
        return self._adaptive_batch.initial_training_values()

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        session = self._adaptive_batch
        super().create_scheduler(num_training_steps=session.clock.nominal_steps, optimizer=optimizer)
        self.lr_scheduler = session.wrap_scheduler(self.lr_scheduler, optimizer or self.optimizer)
        return self.lr_scheduler

    def training_step(self, model, inputs, num_items_in_batch=None):
        return self._adaptive_batch.training_step(super().training_step, model, inputs, num_items_in_batch)

    def log(self, logs, *args, **kwargs):
        self._adaptive_batch.add_metrics(logs)
        return super().log(logs, *args, **kwargs)

    def _load_callback_state(self):
        stored = self.state.stateful_callbacks.pop(STATE_KEY, None)
        try:  # other callbacks restore as usual; ours keeps its live objects instead of being re-created
            return super()._load_callback_state()
        finally:
            # the next save updates this entry in place, so it must exist, also in a plain Trainer's checkpoint
            self.state.stateful_callbacks[STATE_KEY] = stored if stored is not None else {}


_CLASSES: dict[type, type] = {}


def install(trainer: Trainer, config: AdaptiveBatchConfig) -> Session:
    """Check the Trainer's setup, then swap its class for one with `AdaptiveTrainerMixin` in front."""
    if isinstance(trainer, AdaptiveTrainerMixin):
        raise ValueError(
            "This Trainer already has an AdaptiveBatch attached; pass AdaptiveBatch() once, either in "
            "callbacks=[...] or through AdaptiveBatch.attach(trainer), not both."
        )
    check_trainer(trainer)
    prepare_engine(trainer)
    _configure_logger(trainer.args)
    session = Session(trainer, config)
    cls = type(trainer)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"AdaptiveBatch{cls.__name__}", (AdaptiveTrainerMixin, cls), {})
    trainer.__class__ = _CLASSES[cls]
    trainer._adaptive_batch = session
    if trainer.train_dataset is not None:
        session.prepare()  # bad schedules and sizes fail here, before any compute
    return session


def _configure_logger(args) -> None:
    """Show the plan table by default: INFO on the main process unless `log_level` says otherwise.

    A handler is added only where none would receive the records (the user configured no logging), as
    transformers does for its own logger.
    """
    if args.should_log:
        level = logging.INFO if args.log_level == "passive" else args.get_process_log_level()
    else:
        level = args.get_process_log_level()
    logger.setLevel(level)
    if not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


def find_trainer_on_stack(callback) -> Trainer | None:
    """The Trainer whose `__init__` is running and holds `callback` (callbacks get no Trainer reference)."""
    import inspect

    frame = inspect.currentframe()
    try:
        while frame is not None:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer) and callback in getattr(
                getattr(candidate, "callback_handler", None), "callbacks", ()
            ):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame
