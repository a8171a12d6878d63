"""AdaptiveBatch's state for one Trainer and the order of what happens to it: made at attach, planned again when
`train()` starts; it holds the parts that own the rest ([`assemble.Assembly`], `Status`, `Resume`, `Growth`)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict, replace

from ..core import traps
from ..core.checkpoint import SCHEMA_VERSION, PlanIdentity, StoredCheckpoint
from ..core.planning import RunPlan, RunSettings, StepPlan, plan_run
from ..runtime.stream import is_stream
from . import dataloader
from .assemble import Assembly
from .checks import check_trainer
from .growth import Growth, growth_for
from .resume import Resume
from .status import Status, plan_table, plan_text

logger = logging.getLogger("adaptive_batch")


class Session:
    def __init__(self, trainer, callback, loss_scale):
        self.trainer, self.callback, self.config = trainer, callback, callback.config
        self.world_size = max(1, trainer.args.world_size)
        self.rank = trainer.args.process_index
        self.loss_scale = loss_scale  # (the Trainer's compute_loss goes through it: [`loss_scale`])
        self.assembly = Assembly(trainer, self.config, self.world_size, self.rank)
        self.status = Status(trainer, self.config, self.assembly)
        self.run: RunPlan | None = None
        self.identity: PlanIdentity | None = None
        self.resume: Resume | None = None
        self.growth: Growth | None = None
        self.sampler = None  # what the data loader draws steps from (it tells the last step drawn)
        self.slots: dataloader.Slots | None = None  # the loop's batches for each step
        self.counts = dataloader.LoopCounts(trainer)  # what the loop counts for each of its batches

    @property
    def plan(self) -> StepPlan | None:
        return self.run.plan if self.run is not None else None

    @property
    def controller(self):
        return self.assembly.controller

    @property
    def noise(self):
        return self.status.noise

    @property
    def schedule(self):
        args = self.trainer.args
        user_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * self.world_size
        return self.config.resolved_schedule(user_batch)

    def prepare(self, checkpoint: StoredCheckpoint | None = None) -> None:
        """Plan from the arguments, dataset and checkpoint, and build what runs the plan; every refusal comes here."""
        trainer, config, args = self.trainer, self.config, self.trainer.args
        if trainer.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        check_trainer(trainer)
        schedule, stored = self.schedule, checkpoint.state if checkpoint is not None else None
        stream = is_stream(trainer.train_dataset)
        engine = self.assembly.engine()
        self.growth = growth_for(schedule)
        if self.growth is not None:
            workers = args.dataloader_num_workers if stream else 0
            self.growth.check(config, engine, self.world_size, workers, stored)
        self.resume = Resume(checkpoint, args, self.world_size, stream)
        dataset_size = None if stream else len(trainer.train_dataset)
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
            args.per_device_train_batch_size,
            args.gradient_accumulation_steps,
        )
        self.run = plan_run(
            schedule,
            settings,
            config.lr_scaling,
            done=self.resume.done_steps(dataset_size),
            noise_scale_at=self.growth.schedule.noise_scale_at if self.growth is not None else None,
        )
        if self.growth is not None:
            self.growth.check_sizes(self.run, self.world_size)
        self.identity = PlanIdentity(
            dataset_size=self.run.dataset_size,
            budget_samples=self.run.budget.samples,
            drop_last=bool(args.dataloader_drop_last),
            data_seed=args.data_seed if args.data_seed is not None else args.seed,
            shuffle=not stream and args.train_sampling_strategy != "sequential",
            adopted_at_step=self.resume.adoption.global_step if self.resume.adoption else 0,
            schedule=plan_text(schedule),
            lr_scaling=plan_text(config.lr_scaling),
            fingerprint=self.plan.fingerprint(),
        )
        self.resume.check(self.identity)
        self.assembly.build(engine, self.plan, self.identity, checkpoint, growing=self.growth is not None)
        self._follow_model_checks()
        trainer.state.max_steps = self.plan.num_steps
        if checkpoint is not None:
            self.resume.restore(self.plan, self.identity.shuffle, self.status, self.assembly, self.growth)

    def _follow_model_checks(self) -> None:
        """Weigh micro-batches by what the model's loss computes (its label shift, its divisor) and cut their
        trailing padding where the model's rows do not depend on it, as shown on it."""
        checks = self.assembly.checks
        told = checks.loss()
        self.assembly.runner.follow_model(told.shifts_labels, checks.trims())
        self.loss_scale.follow_model(told.reads_items)

    def replan(self, schedule) -> StepPlan:
        """Plan the rest of the run again under a grown `schedule`: everything that reads the plan follows it."""
        plan = self.run.replan(schedule)
        if self.sampler is not None:
            self.sampler.plan = plan
        self.identity = replace(self.identity, fingerprint=plan.fingerprint())
        self.assembly.follow(plan)
        self.trainer.state.max_steps = plan.num_steps
        return plan

    @contextlib.contextmanager
    def training(self, checkpoint: StoredCheckpoint | None):
        """Around `Trainer.train`: plan, log the plan, run the loop as the callback's training session."""
        args = self.trainer.args
        if checkpoint is not None and args.ignore_data_skip:
            raise ValueError(
                "ignore_data_skip=True makes a resumed run read its batches from the first step again, while "
                "AdaptiveBatch's step k must take the samples the plan gives step k. Resume with "
                "ignore_data_skip=False (skipping costs no data loading: only the sampler's indices are skipped)."
            )
        self.status.start(resumed=checkpoint is not None)  # (a checkpoint's counters: restored in `prepare`)
        self.counts = dataloader.LoopCounts(self.trainer)  # (model_init may build another model for this run)
        self.prepare(checkpoint)
        if args.should_log:
            logger.info("%s", plan_table(self.plan_rows()))
            epochs, given = traps.explicit_epochs(args.num_train_epochs), self.config.schedule is not None
            warnings = traps.run_traps(self.run, self.schedule, epochs, schedule_given=given)
            for warning in warnings + self.assembly.probed_traps():
                logger.warning("%s", warning)
            engine = self.assembly.runner.engine
            if self.config.measure_noise and not engine.measures_noise:
                logger.info("The gradient noise scale is not measured under %s.", engine.name)
        self.assembly.check_longest_row()
        try:
            with self.callback._follow(self):
                yield
        finally:
            self.assembly.runner.close()

    def initial_training_values(self) -> tuple:
        """The loop sees one epoch of all steps, each `gradient_accumulation_steps` batches, and runs it as the data
        epochs ([`epochs`])."""
        plan, accumulation = self.plan, self.trainer.args.gradient_accumulation_steps
        return (
            1,  # num_train_epochs of the loop
            plan.num_steps,  # num_update_steps_per_epoch
            plan.dataset_size,  # num_examples
            plan.num_samples,  # num_train_samples
            plan.scheduled[plan.done_steps],  # total_train_batch_size (the first scheduled effective batch)
            plan.num_steps * accumulation,  # steps_in_epoch: the loop's batches
            plan.num_steps,  # max_steps
        )

    def train_dataloader(self):
        args = self.trainer.args
        fixed = self.plan if self.growth is None else None  # (a growing plan's last steps may change)
        self.slots = dataloader.Slots(
            args.gradient_accumulation_steps, args.per_device_train_batch_size, fixed
        )
        loader, self.sampler = dataloader.train_dataloader(
            self.trainer, self.plan, self.identity.data_seed, self.rank, self.identity.shuffle, self.slots
        )
        return loader

    @property
    def batch_changes(self) -> bool:
        """Whether the learning rate must follow the batch: it changes or may change, or a rule scales it (else the
        sample clock is the step count and the Trainer's own scheduler runs as built)."""
        return self.growth is not None or not self.run.clock.counts_steps()

    def batch_samples(self, inner, epoch_iterator, slots: int, device) -> tuple[list, object]:
        """One step's loop batches ([`dataloader.batch_samples`]), each counted as the plain Trainer's batch it stands
        for ([`dataloader.LoopCounts`])."""
        batches, num_items = dataloader.batch_samples(inner, epoch_iterator, slots, device)
        step, plan = self.trainer.state.global_step, self.plan
        rows = len(range(self.rank, plan.sizes[step], self.world_size)) if step < plan.num_steps else 0
        self.counts.follow_step(batches if rows else [], rows)  # (rows: this rank's share of the step)
        return batches, num_items

    def training_step(self, inner_step, model, inputs, num_items_in_batch):
        step, growth, assembly = self.trainer.state.global_step, self.growth, self.assembly
        if growth is not None:
            growth.before_step(step, self.status.last_step, assembly.runner.tape)
        exploring = self.controller.exploring
        split = growth is not None and growth.split(self, step)
        if assembly.check_pending:  # (the engine placed the model in train(): checked before its first step)
            assembly.check_at_step()
            self._follow_model_checks()
        if assembly.lengths_pending:
            assembly.lengths_from_step(inputs)
        per_device, max_rows = self.trainer.args.per_device_train_batch_size, self.plan.max_rows(step)
        with self.loss_scale.step(self.plan.sizes[step], per_device, self.world_size):
            loss = assembly.runner.run(inner_step, model, inputs, num_items_in_batch, max_rows, split=split)
        self.status.after_step(step, self.plan, exploring)
        if growth is not None:
            timed = not exploring and not self.controller.exploring and not assembly.runner.last.retries
            growth.after_step(self, step, timed, split)
        return loss

    def add_metrics(self, logs: dict) -> None:
        if self.status.last_step >= 0 and self.trainer.is_in_train and "loss" in logs:
            logs.update(self.status.metrics(self.run, self.growth))

    def plan_rows(self) -> list[tuple[str, str]]:
        return self.status.plan_rows(self.run, self.growth, self.schedule)

    def current(self) -> dict:
        return self.status.current(self.run, self.growth)

    def state_dict(self) -> dict:
        adoption = self.resume.adoption if self.resume is not None else None
        growth = (
            self.growth.state_dict() if self.growth is not None else {"schedule": None, "step_time": None}
        )
        return {
            "schema": SCHEMA_VERSION,
            "plan": asdict(self.identity) if self.identity else None,
            "adoption": asdict(adoption) if adoption else None,
            "settings": self.config.micro_batch_settings(),
            **self.status.state_dict(),
            **self.assembly.state_dict(),
            **growth,
        }
