"""Custom losses at the plain Trainer's scale: a `compute_loss` that ignores `num_items_in_batch` weighted as the
plain Trainer's steps weigh it. See docs/how-it-works.md, "What it refuses, and why"."""

from __future__ import annotations

import contextlib
import logging
import math

import torch

from ..runtime.compat.trainer import base_model, user_class

logger = logging.getLogger("adaptive_batch")

# a `compute_loss` defined by these normalises by `num_items_in_batch` wherever the Trainer leaves it to the loss
TRUSTED_MODULES = ("transformers.", "trl.")


def _watched(tensor: torch.Tensor):
    """`tensor` as one that notes whether any torch operation read it, and the function that tells."""

    class Watched(torch.Tensor):
        was_read = False

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            cls.was_read = True
            # torch's own handling, for plain tensors: the arguments' subclass is not passed on to the results
            return torch.Tensor.__torch_function__.__func__(torch.Tensor, func, (torch.Tensor,), args, kwargs)

    return tensor.as_subclass(Watched), lambda: Watched.was_read


class LossScale:
    """Weights a `compute_loss` that ignores `num_items_in_batch` as the plain Trainer's steps weigh it."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.reads_items: bool | None = None  # whether the loss reads num_items_in_batch (None: not seen yet)
        self.model_reads_items: bool | None = None  # whether the model's own loss does (None: not told)
        self.plain_micro_batches: int | None = None  # while a step runs: the plain Trainer's in it

    def follow_model(self, reads_items: bool | None) -> None:
        """Whether the model's own loss reads `num_items_in_batch`, as a check on it showed (`None`: not told)."""
        self.model_reads_items = reads_items

    @contextlib.contextmanager
    def step(self, step_size: int, per_device_train_batch_size: int, world_size: int):
        self.plain_micro_batches = math.ceil(step_size / (per_device_train_batch_size * world_size))
        try:
            yield
        finally:
            self.plain_micro_batches = None

    def compute_loss(self, inner, model, inputs, *args, **kwargs):
        """The user's `compute_loss`, its loss weighted where it ignores `num_items_in_batch` in a training step."""
        items = kwargs.get("num_items_in_batch")
        func = getattr(self.trainer, "compute_loss_func", None)
        # where the Trainer divides the loss itself, the divisor is the micro-batch's share ([`runtime.step`] sets it)
        divides = (
            items is None or not getattr(self.trainer, "model_accepts_loss_kwargs", False)
        ) and func is None
        if self.plain_micro_batches is None or divides:
            return inner(model, inputs, *args, **kwargs)
        was_read = lambda: False  # (a compute_loss_func given no num_items_in_batch cannot read it)
        if func is None and user_class(self.trainer, "compute_loss").__module__.startswith(TRUSTED_MODULES):
            # the library's compute_loss leaves the division to the model's loss: [`model_checks.check_loss`] told
            # whether it reads num_items_in_batch (a model's own mean, as BartForCausalLM's, does not)
            if self.model_reads_items is not False:
                return inner(model, inputs, *args, **kwargs)
        elif self.reads_items is None and torch.is_tensor(items):
            kwargs["num_items_in_batch"], was_read = _watched(items)
        result = inner(model, inputs, *args, **kwargs)
        if self.reads_items is None:
            self.reads_items = was_read()
            if not self.reads_items:
                logger.warning("%s", self._warning(func))
        if self.reads_items:
            return result
        # the micro-batch's share of the step (its divisor is the step's units over its own) x the plain micro-batches
        factor = self.plain_micro_batches / self.trainer.current_gradient_accumulation_steps
        return (result[0] * factor, *result[1:]) if isinstance(result, tuple) else result * factor

    def _warning(self, func) -> str:
        where = "compute_loss_func"
        if func is None:
            where = f"{user_class(self.trainer, 'compute_loss').__name__}.compute_loss"
            if self.model_reads_items is False:
                where = f"The loss of {type(base_model(self.trainer.model)).__name__}"
        accumulation = self.trainer.args.gradient_accumulation_steps
        return (
            f"AdaptiveBatch: {where} does not use num_items_in_batch, so each micro-batch's loss is its own mean. "
            "Each is weighted by its share of the step's labels (label tokens, or rows with a label each) times the "
            f"plain Trainer's micro-batches in the step ({accumulation}, gradient_accumulation_steps, at the starting "
            f"batch), so the gradient and the logged loss have the plain Trainer's scale (the sum of {accumulation} "
            "micro-batch means) whatever the cut. For a loss that is exactly the step's mean over its label tokens, "
            "sum the per-token losses and divide by num_items_in_batch, as transformers' model losses do."
        )
