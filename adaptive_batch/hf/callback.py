"""`AdaptiveBatch`: the one line a training script adds."""

from __future__ import annotations

import contextlib
import functools
import os

from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..core.config import AdaptiveBatchConfig, settings_doc, settings_signature
from ..core.steps import StepPlan
from ..runtime.compat.trainer import trainer_being_built
from .install import install
from .resume import guard_plain_resume
from .session import Session


class _attach_method:
    """A method called on the class or on an instance, given both (the instance `None` on the class)."""

    def __init__(self, function):
        self.function = function
        functools.update_wrapper(self, function)

    def __get__(self, instance, owner):
        return functools.partial(self.function, owner, instance)


class AdaptiveBatch(TrainerCallback, ExportableState):
    """Keeps the effective batch exact while choosing how each optimizer step is cut into micro-batches.

    `callbacks=[AdaptiveBatch()]` on a Trainer (`transformers.Trainer`, TRL's `SFTTrainer`, a subclass), or
    `AdaptiveBatch.attach(trainer)`. With no arguments the effective batch is the user's (`per_device_train_batch_size
    x gradient_accumulation_steps x world size`) and only the micro-batching changes. One instance may serve several
    Trainers in turn, each with its own plan and state.

    Args:
    {settings}

    The budget is counted in samples: at a constant batch the steps, epochs and learning rate are the plain
    Trainer's. What it logs (`adaptive_batch/*` keys): README, "What it logs"; how: docs/how-it-works.md.
    """

    def __init__(self, schedule=None, **settings):
        self.config = AdaptiveBatchConfig.from_settings(schedule=schedule, **settings)
        self.session: Session | None = None  # the session of the Trainer attached last
        self.training_session: Session | None = None  # the session whose Trainer is inside train()

    @_attach_method
    def attach(cls, self, trainer: Trainer, **config) -> AdaptiveBatch:
        """Attach to a Trainer that is already built: `AdaptiveBatch.attach(trainer, **config)` or
        `AdaptiveBatch(**config).attach(trainer)`. Returns the attached callback."""
        if self is None:
            self = cls(**config)
        elif config:
            raise TypeError(
                "Pass the settings to AdaptiveBatch(...), not to attach(), when calling it on an instance."
            )
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        self.session = install(trainer, self)
        return self

    @property
    def plan(self) -> StepPlan:
        """The step plan (read it, do not change it): `plan.sizes[k]` samples in step `k` over all GPUs."""
        return self._session("plan").plan

    def plan_table(self) -> list[tuple[str, str]]:
        """The plan as (label, value) rows, as logged when training starts."""
        return self._session("plan_table()").plan_rows()

    def current(self) -> dict:
        """Where the run stands after its last optimizer step (before training: what step 0 will run); README,
        "Reading the plan and the run from Python", lists the keys."""
        return self._session("current()").current()

    def _session(self, what: str) -> Session:
        session = self.training_session or self.session
        if session is None or session.plan is None:
            raise RuntimeError(
                f"AdaptiveBatch.{what} is known once the Trainer is built with AdaptiveBatch in its callbacks (or "
                "after AdaptiveBatch.attach(trainer))."
            )
        return session

    @contextlib.contextmanager
    def _follow(self, session: Session):
        """The callback's events and checkpoint state follow `session` while its Trainer is inside `train()`."""
        previous, self.training_session = self.training_session, session
        try:
            yield
        finally:
            self.training_session = previous

    def on_init_end(self, args, state, control, **kwargs):
        trainer = trainer_being_built(self)
        if trainer is None:
            raise RuntimeError(
                "AdaptiveBatch could not find the Trainer being built. Call AdaptiveBatch.attach(trainer) after "
                "building it instead of passing AdaptiveBatch() in callbacks."
            )
        self.attach(trainer)

    def on_train_begin(self, args, state, control, **kwargs):
        if self.training_session is None:
            raise RuntimeError(
                "AdaptiveBatch was added after the Trainer was built (trainer.add_callback), so it cannot plan the "
                "steps. Use AdaptiveBatch.attach(trainer) instead, before train()."
            )
        self.session = self.training_session
        state.num_train_epochs = self.session.plan.num_epochs

    def on_step_end(self, args, state, control, **kwargs):
        """`state.epoch`: the data epochs the plan's steps have taken ([`epochs`] runs each as the loop's epoch)."""
        state.epoch = self.training_session.plan.epoch_after(state.global_step - 1)

    def on_save(self, args, state, control, **kwargs):
        """Guard the checkpoint against a plain Trainer's resume; every process writes its measurements into it."""
        session = self.training_session
        if session is None:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if args.should_save:
            guard_plain_resume(folder, state.global_step, session.run, args)
        if os.path.isdir(folder):  # (saved elsewhere: a hyperparameter search's trial folder)
            session.assembly.write_tape(folder)

    def on_train_end(self, args, state, control, **kwargs):
        """Every process writes its measurements into the output_dir (what `replay=` follows)."""
        if self.training_session is not None and args.output_dir:
            self.training_session.assembly.write_tape(args.output_dir)

    def state(self) -> dict:
        session = self.training_session or self.session
        checkpoint = session.state_dict() if session is not None else {}
        return {"args": {}, "attributes": {"checkpoint": checkpoint}}


AdaptiveBatch.__init__.__signature__ = settings_signature()
AdaptiveBatch.__doc__ = AdaptiveBatch.__doc__.replace("    {settings}", settings_doc(indent=8))
