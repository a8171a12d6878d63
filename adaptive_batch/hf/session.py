"""AdaptiveBatch's state for one Trainer, and the order in which things happen to it.

A `Session` is made when AdaptiveBatch is attached to a Trainer and planned again when `train()` starts (the
arguments or the dataset may have changed, and a checkpoint may be resumed). Each job is done elsewhere: the plan
by [`core.planning`], the choice of the controller and the step runner by [`assemble`], resuming by [`resume`],
growing the batch by [`growth`], the dataloader by [`dataloader`], the metrics and the plan table by [`status`],
a custom loss's scale by [`loss_scale`].
While its Trainer is inside `train()`, the session is its callback's `training_session`: the callback's events and
checkpoint state follow that one, so one AdaptiveBatch instance can serve several Trainers in turn (a sweep, a
notebook cell run twice).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict, replace
from typing import TYPE_CHECKING

from ..core import traps
from ..core.checkpoint import SCHEMA_VERSION, PlanIdentity, StoredCheckpoint
from ..core.planning import RunPlan, RunSettings, plan_run
from ..runtime.stream import is_stream
from . import assemble, dataloader, resume, status
from .checks import check_trainer
from .growth import Growth, growth_for

if TYPE_CHECKING:
    # (through planning: the session imports at most 10 of the package's modules, tests/test_layers.py)
    from ..core.planning import StepPlan

logger = logging.getLogger("adaptive_batch")


class Session:
    """AdaptiveBatch's state for one Trainer. See the module docstring."""

    def __init__(self, trainer, callback, loss_scale):
        self.trainer, self.callback, self.config = trainer, callback, callback.config
        args = trainer.args
        self.world_size = max(1, args.world_size)
        self.rank = args.process_index
        self.run: RunPlan | None = None
        self.identity: PlanIdentity | None = None
        self.adoption = None
        self.controller = None
        # the dataset could not tell its rows' lengths: the first step tells them
        self.lengths_pending = False
        self.runner = None
        self.sampler = None  # what the data loader draws steps from (it tells the last step drawn)
        self.growth: Growth | None = None
        self.noise = assemble.noise_averages(self.config)
        self.loss_scale = loss_scale  # (the Trainer's compute_loss goes through it: [`loss_scale`])
        self.tokens_seen, self.last_step = 0, -1
        self.settled_at_step: int | None = None  # the first step run after the controller stopped measuring
        self.eval_pieces = assemble.eval_pieces(
            trainer, self.config, self.world_size
        )  # None: the plain evaluation
        self.eval_growth = assemble.eval_growth(
            trainer, self.config, self.eval_pieces
        )  # None: the user's size

    @property
    def per_device_train_batch_size(self) -> int:
        return self.trainer.args.per_device_train_batch_size

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.trainer.args.gradient_accumulation_steps

    @property
    def plan(self) -> StepPlan | None:
        return self.run.plan if self.run is not None else None

    @property
    def schedule(self):
        """The effective batch over training: the user's `per_device x accumulation x world size` by default."""
        user_batch = self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size
        return self.config.resolved_schedule(user_batch)

    @property
    def is_stream(self) -> bool:
        return is_stream(self.trainer.train_dataset)

    # -- planning ------------------------------------------------------------------------------------------------

    def prepare(self, checkpoint: StoredCheckpoint | None = None) -> None:
        """Plan from the current arguments and dataset (and the checkpoint to resume, if any); build the clock, the
        controller and the step runner. Every refusal happens here, before any compute."""
        trainer, config, args = self.trainer, self.config, self.trainer.args
        if trainer.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        check_trainer(trainer)
        schedule, stored = self.schedule, checkpoint.state if checkpoint is not None else None
        engine = assemble.engine(trainer, self.world_size)
        self.growth = growth_for(schedule)
        if self.growth is not None:
            self.growth.check(self, engine, stored["schedule"] if stored else None)
        self.adoption = resume.adoption(self, checkpoint)
        dataset_size = None if self.is_stream else len(trainer.train_dataset)
        unit = "samples"
        if getattr(args, "packing", False):
            unit = "packed rows (TRL's packing=True puts several of your examples into each row of max_length tokens)"
        settings = RunSettings(
            dataset_size,
            args.num_train_epochs,
            args.max_steps,
            self.world_size,
            args.dataloader_drop_last,
            unit,
            self.per_device_train_batch_size,
            self.gradient_accumulation_steps,
        )
        self.run = plan_run(
            schedule,
            settings,
            config.lr_scaling,
            done=resume.done_steps(self.adoption, dataset_size),
            noise_scale_at=self.growth.schedule.noise_scale_at if self.growth is not None else None,
        )
        if self.growth is not None:
            self.growth.check_sizes(self.run, self.world_size)
        self.identity = PlanIdentity(
            dataset_size=self.run.dataset_size,
            budget_samples=self.run.budget.samples,
            drop_last=bool(args.dataloader_drop_last),
            data_seed=args.data_seed if args.data_seed is not None else args.seed,
            shuffle=not self.is_stream and args.train_sampling_strategy != "sequential",
            adopted_at_step=self.adoption.global_step if self.adoption else 0,
            schedule=status.schedule_text(self),
            lr_scaling=status.rule_text(config.lr_scaling),
            fingerprint=self.plan.fingerprint(),
        )
        resume.check_identity(self, checkpoint)
        if self.controller is None or checkpoint is not None:  # a second train() keeps what the first learned
            self.controller = assemble.controller(self, engine)
        self.runner = assemble.runner(self, engine)
        assemble.tape(self, checkpoint)  # (a replay of another run's record is refused here)
        self.replan(self.plan)
        if checkpoint is not None:
            resume.restore(self, checkpoint)

    def replan(self, plan: StepPlan) -> None:
        """Make everything that follows the plan follow `plan`: the LR clock, the data loader's steps, the
        controller's row limit, the checkpoint's identity and the Trainer's step count. For the first plan and for
        each one a growing schedule makes."""
        self.run.plan = self.run.clock.plan = plan
        if self.sampler is not None:
            self.sampler.plan = plan
        self.identity = replace(self.identity, fingerprint=plan.fingerprint())
        self.controller.set_row_limit(plan.max_rows_per_rank)
        self.trainer.state.max_steps = plan.num_steps

    # -- a run ---------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def training(self, checkpoint: StoredCheckpoint | None):
        """Around `Trainer.train`: plan (taking the checkpoint into account), log the plan, run the loop as the
        callback's training session."""
        args = self.trainer.args
        if checkpoint is None:
            self.tokens_seen, self.last_step, self.settled_at_step = 0, -1, None
        elif args.ignore_data_skip:
            raise ValueError(
                "ignore_data_skip=True makes a resumed run read its batches from the first step again, while "
                "AdaptiveBatch's step k must take the samples the plan gives step k. Resume with "
                "ignore_data_skip=False (skipping costs no data loading: only the sampler's indices are skipped)."
            )
        self.noise = assemble.noise_averages(self.config)  # (a checkpoint's averages are read in `prepare`)
        self.prepare(checkpoint)
        if args.should_log:
            logger.info("%s", status.plan_table(self))
            epochs, given = traps.explicit_epochs(args.num_train_epochs), self.config.schedule is not None
            for warning in traps.run_traps(self.run, self.schedule, epochs, schedule_given=given):
                logger.warning("%s", warning)
            for warning in assemble.probed_traps(self):
                logger.warning("%s", warning)
            if self.config.measure_noise and not self.runner.engine.measures_noise:
                logger.info("The gradient noise scale is not measured under %s.", self.runner.engine.name)
        assemble.check_longest_row(self)
        previous, self.callback.training_session = self.callback.training_session, self
        try:
            yield
        finally:
            self.callback.training_session = previous
            self.runner.close()

    def initial_training_values(self) -> tuple:
        """What `Trainer.set_initial_training_values` returns, from the plan: the loop sees one epoch of all steps,
        each `gradient_accumulation_steps` batches of the data loader (the step batch in the last).

        Data epochs are tracked by the callback (`state.epoch`, epoch-end evaluation and saving).
        """
        plan = self.plan
        return (
            1,  # num_train_epochs of the loop
            plan.num_steps,  # num_update_steps_per_epoch
            plan.dataset_size,  # num_examples
            plan.num_samples,  # num_train_samples
            plan.scheduled[plan.done_steps],  # total_train_batch_size (the first scheduled effective batch)
            plan.num_steps * self.gradient_accumulation_steps,  # steps_in_epoch: the loop's batches
            plan.num_steps,  # max_steps
        )

    def train_dataloader(self):
        loader, self.sampler = dataloader.train_dataloader(
            self.trainer, self.plan, self.identity.data_seed, self.rank, self.identity.shuffle
        )
        return loader

    @property
    def batch_changes(self) -> bool:
        """Whether the learning rate must follow the batch: it changes, or a rule scales it."""
        plan = self.plan
        return (
            len(set(plan.sizes[plan.done_steps :])) > 1
            or self.config.lr_scaling != "none"
            or self.growth is not None
        )

    def training_step(self, inner_step, model, inputs, num_items_in_batch):
        step, growth = self.trainer.state.global_step, self.growth
        if growth is not None:
            growth.before_step(step, self.last_step, self.runner.tape)
        exploring = self.controller.exploring
        split = growth is not None and growth.split(self, step)
        if self.lengths_pending:
            assemble.lengths_from_step(self, inputs)
        with self.loss_scale.step(self.plan.sizes[step], self.per_device_train_batch_size, self.world_size):
            loss = self.runner.run(
                inner_step, model, inputs, num_items_in_batch, self.plan.max_rows(step), split=split
            )
        self.tokens_seen += self.runner.last.real_tokens
        self.last_step = step
        if self.settled_at_step is None and not self.controller.exploring:
            self.settled_at_step = step if not exploring else step + 1
        self._average_noise(step)
        if growth is not None:
            timed = not exploring and not self.controller.exploring and not self.runner.last.retries
            growth.after_step(self, step, timed, split)
        return loss

    def _average_noise(self, step: int) -> None:
        """Average in what the step measured for the noise scale, its tr(Sigma) per sample of the step."""
        measured = self.runner.last.noise
        if self.noise is None or measured is None:
            return
        samples = self.plan.sizes[step]
        estimate = measured.sums.estimate(measured.step_norm_sq, samples)
        if not self.noise.update(estimate, samples, self.plan.samples_before_step[step + 1]):
            self.runner.noise.warn_once(
                "non-finite",
                f"Step {step}'s gradient noise estimates are not finite (|G|^2={estimate.grad_norm_sq}, "
                f"tr(Sigma)={estimate.grad_variance}; an fp16 overflow, or a NaN loss): such steps are left out of "
                "the noise scale's averages.",
            )

    def add_metrics(self, logs: dict) -> None:
        if self.last_step >= 0 and self.trainer.is_in_train and "loss" in logs:
            logs.update(status.metrics(self))

    # -- checkpoints ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Plain JSON for the checkpoint (see `core/checkpoint.py`)."""
        growth = (
            self.growth.state_dict() if self.growth is not None else {"schedule": None, "step_time": None}
        )
        return {
            "schema": SCHEMA_VERSION,
            "plan": asdict(self.identity) if self.identity else None,
            "adoption": self.adoption.to_dict() if self.adoption else None,
            "settings": self.config.micro_batch_settings(),
            "tokens_seen": self.tokens_seen,
            "last_step": self.last_step,
            "settled_at_step": self.settled_at_step,
            "micro_batch": self.controller.state_dict() if self.controller else None,
            "last_micro_batch_size": self.runner.last.micro_batch_size if self.runner else 0,
            "last_accumulation_steps": self.runner.last.accumulation_steps if self.runner else 0,
            "flattened": bool(self.runner.flatten) if self.runner else False,
            "noise": self.noise.state_dict() if self.noise is not None else None,
            **growth,
        }
