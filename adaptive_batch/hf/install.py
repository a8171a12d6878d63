"""Wiring into `transformers.Trainer`: [`AdaptiveTrainerMixin`], put in front of the Trainer's class, hands the loop's
steps, data, scheduler, loss, logs and evaluation to the [`session.Session`]."""

from __future__ import annotations

import contextlib
import logging
import sys

import torch
from torch.utils.data import DataLoader

from ..runtime.compat.trainer import KeepsLiveCallbackState, put_in_front
from ..runtime.engines import prepare as prepare_engine
from ..runtime.lr_scheduler import follow_sample_clock
from . import dataloader
from .checks import check_trainer
from .epochs import data_epochs
from .loss_scale import LossScale
from .resume import STATE_KEY, read_checkpoint, readable_by_the_trainer
from .session import Session

logger = logging.getLogger("adaptive_batch")


class AdaptiveTrainerMixin(KeepsLiveCallbackState):
    """Placed in front of the user's Trainer class; keeps AdaptiveBatch's live callback when a checkpoint's callback
    states are restored (its state was read when `train` started)."""

    _adaptive_batch: Session
    _adaptive_batch_mixin = True  # the methods here replace the Trainer's; `check_trainer` looks past them
    callback_state_key = STATE_KEY

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if isinstance(resume_from_checkpoint, bool) and resume_from_checkpoint:
            from transformers.trainer_utils import get_last_checkpoint

            # as the Trainer does; when none is found it raises its own error
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir) or True
        checkpoint = (
            read_checkpoint(resume_from_checkpoint) if isinstance(resume_from_checkpoint, str) else None
        )
        with (
            self._adaptive_batch.training(checkpoint),
            readable_by_the_trainer(checkpoint.path if checkpoint else None) as path,
        ):
            return super().train(path if checkpoint else resume_from_checkpoint, *args, **kwargs)

    def get_train_dataloader(self) -> DataLoader:
        return self._adaptive_batch.train_dataloader()

    def _run_epoch(self, **loop_arguments):
        # the loop's one epoch, run as the plan's data epochs ([`epochs`]): the loop sent the first on_epoch_begin
        resumed = loop_arguments["resume_from_checkpoint"] is not None
        for index, arguments in enumerate(data_epochs(self.state, self._adaptive_batch, resumed)):
            if index:
                self.control = self.callback_handler.on_epoch_begin(self.args, self.state, self.control)
            super()._run_epoch(**loop_arguments | arguments)
            if self.control.should_training_stop:
                return

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        return self._adaptive_batch.batch_samples(
            super().get_batch_samples, epoch_iterator, num_batches, device
        )

    def floating_point_ops(self, inputs):
        # (the loop counts each of its batches: each counts the plain Trainer's batch it stands for)
        return self._adaptive_batch.counts.floating_point_ops(super().floating_point_ops, inputs)

    def _track_num_input_tokens(self, inputs):
        return super()._track_num_input_tokens(self._adaptive_batch.counts.share(inputs))

    def set_initial_training_values(self, args, train_dataloader):
        return self._adaptive_batch.initial_training_values()

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        session = self._adaptive_batch
        if (
            session.callback.training_session is not session
        ):  # (outside train(): as asked, as the plain Trainer)
            return super().create_scheduler(num_training_steps=num_training_steps, optimizer=optimizer)
        # the schedule's length: the plain Trainer's steps at the starting batch, which the sample clock maps onto
        super().create_scheduler(num_training_steps=session.run.clock.nominal_steps, optimizer=optimizer)
        self.lr_scheduler = follow_sample_clock(
            self.lr_scheduler, optimizer or self.optimizer, session.run.clock, session.batch_changes
        )
        return self.lr_scheduler

    def training_step(self, model, inputs, num_items_in_batch=None):
        if isinstance(inputs, dataloader.EmptySlot):
            return torch.zeros((), device=self.args.device)
        return self._adaptive_batch.training_step(super().training_step, model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, *args, **kwargs):
        return self._adaptive_batch.loss_scale.compute_loss(
            super().compute_loss, model, inputs, *args, **kwargs
        )

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        pieces = self._adaptive_batch.assembly.eval_pieces
        if pieces is None:  # (else an eval batch that runs out of memory runs again in pieces)
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        return pieces.run(super().prediction_step, model, inputs, prediction_loss_only, ignore_keys)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval", *args, **kwargs):
        with self._eval_sized(metric_key_prefix):
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix, *args, **kwargs)

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix="test", *args, **kwargs):
        with self._eval_sized(metric_key_prefix):
            return super().predict(test_dataset, ignore_keys, metric_key_prefix, *args, **kwargs)

    def _eval_sized(self, prefix: str):
        # adapt_evaluation="grow": the eval batch it chose
        growth = self._adaptive_batch.assembly.eval_growth
        return growth.sized(prefix) if growth is not None else contextlib.nullcontext()

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        pieces, growth = self._adaptive_batch.assembly.eval_pieces, self._adaptive_batch.assembly.eval_growth
        if pieces is not None:
            pieces.begin()
        dataset = getattr(dataloader, "dataset", None)
        with growth.measured(metric_key_prefix, dataset) if growth is not None else contextlib.nullcontext():
            output = super().evaluation_loop(
                dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
            )
        if pieces is not None:
            output.metrics.update(pieces.metrics(metric_key_prefix))
        return output

    def log(self, logs, *args, **kwargs):
        self._adaptive_batch.add_metrics(logs)
        return super().log(logs, *args, **kwargs)


def install(trainer, callback) -> Session:
    """Check the Trainer, put `AdaptiveTrainerMixin` in front of its class, and plan at once where it has a training
    dataset, so that bad schedules and sizes fail before any compute."""
    if isinstance(trainer, AdaptiveTrainerMixin):
        raise ValueError(
            "This Trainer already has an AdaptiveBatch attached; pass AdaptiveBatch() once, either in "
            "callbacks=[...] or through AdaptiveBatch.attach(trainer), not both."
        )
    check_trainer(trainer)
    prepare_engine(trainer)
    _configure_logger(trainer.args)
    session = Session(trainer, callback, LossScale(trainer))
    put_in_front(trainer, AdaptiveTrainerMixin, prefix="AdaptiveBatch")
    trainer._adaptive_batch = session
    if trainer.train_dataset is not None:
        session.prepare()
    return session


def _configure_logger(args) -> None:
    """Show the plan table by default: INFO on the main process unless `log_level` says otherwise (stderr if unset)."""
    passive = args.should_log and args.log_level == "passive"
    logger.setLevel(logging.INFO if passive else args.get_process_log_level())
    if not any(isinstance(handler, _ShownWhereUnconfigured) for handler in logger.handlers):
        handler = _ShownWhereUnconfigured()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)


class _ShownWhereUnconfigured(logging.StreamHandler):
    """Writes a record to stderr only where no other handler on its way up would receive it."""

    def emit(self, record: logging.LogRecord) -> None:
        current = logging.getLogger(record.name)
        while current is not None:  # (the way up a record takes, as `Logger.callHandlers` walks it)
            if any(h is not self and not isinstance(h, logging.NullHandler) for h in current.handlers):
                return
            if not current.propagate:
                break
            current = current.parent
        self.stream = sys.stderr  # the one now (pytest, notebooks and the user may have replaced it)
        super().emit(record)
