"""AdaptiveBatch's state for one Trainer: the plan, the sample clock, the micro-batches, resuming, and the logs.

A `Session` is made when AdaptiveBatch is attached to a Trainer and planned again when `train()` starts (the
arguments or the dataset may have changed, and a checkpoint may be resumed). While a Trainer is inside `train()`,
its session is `Session.active`: the callback's events and checkpoint state follow that one, so one AdaptiveBatch
instance can serve several Trainers in turn (a sweep, a notebook cell run twice).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict, replace
from typing import ClassVar

import torch.distributed as dist
from torch.utils.data import DataLoader
from transformers import Trainer

from ..core import report
from ..core.checkpoint import (
    Adoption,
    MicroBatchSettings,
    PlanIdentity,
    StoredCheckpoint,
    identity_error,
    learned_state_applies,
)
from ..core.config import AdaptiveBatchConfig
from ..core.goodput import NoiseScaleSchedule, StepTimeModel
from ..core.lr import SampleClock, gain_power, nominal_steps
from ..core.noise import NoiseScale
from ..core.plain_trainer import PlainBatching
from ..core.plan import Budget, StepPlan, build_plan
from ..core.rows import RowController
from ..core.schedule import Progress, check_effective_batch_size, describe
from ..core.tokens import TokenController
from ..runtime import compat, lengths
from ..runtime.engines import Engine, engine_for
from ..runtime.lr_scheduler import follow_sample_clock
from ..runtime.memory import memory_limit
from ..runtime.noise_hooks import GradientNoiseMeter
from ..runtime.sampler import StepBatchSampler
from ..runtime.step import MicroBatchRunner
from ..runtime.stream import StepStream, is_stream
from .checks import check_trainer

logger = logging.getLogger("adaptive_batch")


class Session:
    """AdaptiveBatch's state for one Trainer. See the module docstring."""

    active: ClassVar[Session | None] = None  # the session whose Trainer is inside train()

    def __init__(self, trainer: Trainer, config: AdaptiveBatchConfig):
        self.trainer = trainer
        self.config = config
        args = trainer.args
        # the user's settings, read before AdaptiveBatch runs the loop with gradient accumulation 1
        self.per_device_train_batch_size = args.per_device_train_batch_size
        self.gradient_accumulation_steps = args.gradient_accumulation_steps
        self.world_size = max(1, args.world_size)
        self.rank = args.process_index
        self.plan: StepPlan | None = None
        self.clock: SampleClock | None = None
        self.budget: Budget | None = None
        self.identity: PlanIdentity | None = None
        self.adoption: Adoption | None = None
        self.controller: RowController | None = None
        self.runner: MicroBatchRunner | None = None
        self.tokens_seen = 0
        self.last_step = -1
        self.noise = self._new_noise()
        self.sampler: StepBatchSampler | None = None
        self.growing: NoiseScaleSchedule | None = None  # the schedule when it grows by goodput
        self.step_time = StepTimeModel()
        self._timing: tuple[float, tuple[int, int] | None] | None = (
            None  # (start of the last step, what it ran)
        )
        self._usual_micro_batches = (
            1  # a step's micro-batches on a rank, outside the steps cut in two to measure
        )

    # -- planning ------------------------------------------------------------------------------------------------

    @property
    def default_effective_batch_size(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size

    @property
    def settings(self) -> MicroBatchSettings:
        config = self.config
        return MicroBatchSettings(
            config.micro_batch_size,
            config.max_micro_batch_size,
            config.max_tokens_per_micro_batch,
            config.micro_batch_overhead,
            config.padding_free,
        )

    def prepare(self, checkpoint: StoredCheckpoint | None = None) -> None:
        """Plan from the current arguments and dataset (and the checkpoint to resume, if any); build the clock and
        the micro-batch controller. Every refusal happens here, before any compute."""
        trainer, config, args = self.trainer, self.config, self.trainer.args
        dataset = trainer.train_dataset
        if dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        check_trainer(trainer)
        schedule = config.resolved_schedule(self.default_effective_batch_size)
        self.growing = schedule if isinstance(schedule, NoiseScaleSchedule) else None
        starting = check_effective_batch_size(schedule(Progress(0, 0, 0.0)), where="The schedule at step 0")
        if args.max_steps > 0:
            self.budget = Budget.from_max_steps(args.max_steps, starting)
        else:
            self.budget = Budget.from_epochs(args.num_train_epochs, len(dataset))
        # a stream is one pass over the budget, read in order (stream.py)
        self.dataset_size = self.budget.samples if is_stream(dataset) else len(dataset)
        engine = engine_for(trainer, self.world_size)
        if self.growing is not None:
            self._check_growing(checkpoint, engine)
        self.adoption = self._adoption(checkpoint)
        done = None
        if self.adoption is not None:
            adopted = self.adoption
            plain = PlainBatching(
                self.dataset_size,
                adopted.per_device_train_batch_size,
                adopted.gradient_accumulation_steps,
                adopted.world_size,
                adopted.drop_last,
            )
            done = plain.done_steps(adopted.global_step)
        self._done = done
        self.plan = self._build_plan(schedule)
        self.clock = SampleClock(
            self.plan,
            config.rule,
            starting,
            nominal_steps(self.budget.samples, starting),
            gain_power=gain_power(config.lr_scaling),
            noise_scale_at=self.growing.noise_scale_at if self.growing is not None else None,
        )
        self.clock.check()
        if self.growing is not None:  # every size it may grow to, before any compute
            for size in self.growing.sizes(self.world_size):
                self.clock.multiplier(size)
        self.identity = PlanIdentity(
            dataset_size=self.dataset_size,
            budget_samples=self.budget.samples,
            drop_last=bool(args.dataloader_drop_last),
            data_seed=self._data_seed(),
            shuffle=self._shuffle(),
            adopted_at_step=self.adoption.global_step if self.adoption else 0,
            fingerprint=self.plan.fingerprint(),
        )
        if checkpoint is not None and checkpoint.state is not None:
            stored = checkpoint.state.get("plan") or {"fingerprint": checkpoint.state.get("plan_fingerprint")}
            differences = self.identity.differences(stored)
            if differences:
                raise ValueError(identity_error(differences))
        if self.controller is None or checkpoint is not None:  # a second train() keeps what the first learned
            self.controller = self._new_controller(engine)
        self.controller.row_limit = self.plan.max_rows_per_rank
        if isinstance(self.controller, TokenController):  # the row cap, under a plan that may be new
            self.controller.size = self._token_row_cap()
        self.runner = MicroBatchRunner(
            trainer,
            self.controller,
            self.world_size,
            engine,
            packed=compat.padding_free(trainer),
            flatten=config.padding_free,
            noise=GradientNoiseMeter(config.noise_preconditioner, args.device)
            if config.measure_noise and engine.measures_noise
            else None,
        )
        if checkpoint is not None:
            self._restore(checkpoint)

    def _build_plan(self, schedule) -> StepPlan:
        args = self.trainer.args
        return build_plan(
            schedule,
            self.dataset_size,
            self.budget,
            self.world_size,
            args.dataloader_drop_last,
            done=self._done,
            unit=_dataset_unit(args),
        )

    def _check_growing(self, checkpoint: StoredCheckpoint | None, engine: Engine) -> None:
        """A NoiseScaleSchedule's requirements, and its changes: none for a new run, a checkpoint's to resume."""
        schedule, config = self.growing, self.config
        if not config.measure_noise:
            raise ValueError(
                "schedule=NoiseScaleSchedule(...) decides by the gradient noise scale, but measure_noise=False turns "
                "its measurement off. Leave measure_noise=True (the default), or use a PhaseSchedule."
            )
        if not engine.measures_noise:
            raise ValueError(
                f"schedule=NoiseScaleSchedule(...) decides by the gradient noise scale, which is not measured under "
                f"{engine.name}. Use a PhaseSchedule, or train under DDP."
            )
        if schedule.start % self.world_size:
            raise ValueError(
                f"NoiseScaleSchedule start={schedule.start} is not divisible by world_size={self.world_size}: every "
                f"rank must take the same share. Use {schedule.start // self.world_size * self.world_size or self.world_size} "
                "or a multiple of the world size."
            )
        largest = schedule.sizes(self.world_size)[-1]
        if largest > self.dataset_size:
            raise ValueError(
                f"NoiseScaleSchedule may grow the effective batch to {largest}, more than the dataset's "
                f"{self.dataset_size} {_dataset_unit(self.trainer.args)}: one optimizer step cannot "
                f"hold more than one epoch. Use max_size <= {self.dataset_size}."
            )
        if is_stream(self.trainer.train_dataset) and self.trainer.args.dataloader_num_workers > 0:
            raise ValueError(
                f"NoiseScaleSchedule with a training stream and dataloader_num_workers="
                f"{self.trainer.args.dataloader_num_workers}: the stream is read in a worker process, which a new "
                "plan cannot reach after a change. Use dataloader_num_workers=0, or a map-style dataset."
            )
        schedule.reset()
        stored = checkpoint.state.get("schedule") if checkpoint is not None and checkpoint.state else None
        if stored:
            schedule.load_state_dict(stored)

    def _new_noise(self) -> NoiseScale | None:
        config = self.config
        return NoiseScale(config.noise_time_constant_samples) if config.measure_noise else None

    def _new_controller(self, engine: Engine) -> RowController | TokenController:
        """Under an engine that cannot retry an out-of-memory error, a size or budget grows only where memory
        predicts it fits (`oom_is_fatal`)."""
        config, args = self.config, self.trainer.args
        limit = memory_limit(args.device, config.memory_headroom)
        budget = config.max_tokens_per_micro_batch
        tune = budget is None and config.auto and self._cut_by_tokens()
        if tune:  # the per-device size the user (or the probe) gave, at the longest row
            seq_len = lengths.longest(self.trainer.train_dataset)
            max_length = getattr(args, "max_length", None)
            if max_length:  # TRL truncates to max_length
                seq_len = min(seq_len, max_length)
            budget = self._probed_start() * seq_len
        if budget is not None:
            return TokenController(
                budget,
                self._token_row_cap(),
                tune=tune,
                overhead=config.micro_batch_overhead,
                memory_limit=limit,
                oom_is_fatal=not engine.retries,
            )
        return RowController(
            config.micro_batch_size if not config.auto else self._probed_start(),
            auto=config.auto,
            max_size=config.max_micro_batch_size,
            row_limit=self.plan.max_rows_per_rank,
            growth_margin=config.growth_margin,
            memory_limit=limit,
            oom_is_fatal=not engine.retries,
        )

    def _token_row_cap(self) -> int:
        """The most rows a micro-batch cut by tokens holds: a step's rows on one rank, capped by
        max_micro_batch_size and by an int micro_batch_size."""
        config, cap = self.config, self.plan.max_rows_per_rank
        for stated in (config.max_micro_batch_size, None if config.auto else config.micro_batch_size):
            if stated is not None:
                cap = min(cap, stated)
        return cap

    def _cut_by_tokens(self) -> bool:
        """Whether "auto" cuts steps by tokens: the dataset's rows are known to vary in length and the collator
        pads them (padding-free sequences are cut as rows, by the measured speed of each size: with sdpa a larger
        packed micro-batch can be slower, its mask being quadratic in all its tokens)."""
        padding_free = compat.padding_free(self.trainer) or self.config.padding_free
        return lengths.varies(self.trainer.train_dataset) and not padding_free

    def _adoption(self, checkpoint: StoredCheckpoint | None) -> Adoption | None:
        """How the plan takes over from a plain Trainer's checkpoint: the one resumed now, or the one a resumed
        AdaptiveBatch checkpoint took over from."""
        if checkpoint is None:
            return None
        if checkpoint.state is not None:
            stored = checkpoint.state.get("adoption")
            return Adoption.from_dict(stored) if stored else None
        if checkpoint.global_step == 0:
            return None
        args = self.trainer.args
        if is_stream(self.trainer.train_dataset):
            raise ValueError(
                f"{checkpoint.path} was written by the plain Trainer, whose reading of a training stream "
                "AdaptiveBatch cannot replay exactly. Start a new run with AdaptiveBatch, or resume without it."
            )
        return Adoption(
            global_step=checkpoint.global_step,
            # what the plain Trainer recorded; the rest is taken from the arguments of this run
            per_device_train_batch_size=checkpoint.train_batch_size or self.per_device_train_batch_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            world_size=self.world_size,
            drop_last=bool(args.dataloader_drop_last),
        )

    def _probed_start(self) -> int:
        """Where 'auto' starts: a cached `adaptive-batch probe` result for this setup, else the per-device size.
        When the cache holds another setup, one line says which field differs."""
        from ..probe.cache import cached_start, describe_setup

        trainer, args = self.trainer, self.trainer.args
        seq_len = getattr(args, "max_length", None) or lengths.longest(trainer.train_dataset)
        if seq_len is None or not hasattr(trainer.model, "config"):
            return self.per_device_train_batch_size
        setup = describe_setup(trainer.model, args.optim, bool(args.gradient_checkpointing))
        start = cached_start(setup, seq_len)
        if start.message is not None:
            logger.info("%s", start.message)
        return start.size if start.size is not None else self.per_device_train_batch_size

    def _data_seed(self) -> int:
        args = self.trainer.args
        return args.data_seed if args.data_seed is not None else args.seed

    def _shuffle(self) -> bool:
        """Whether each epoch is a permutation (a stream is read in its own order, whatever the strategy)."""
        if is_stream(self.trainer.train_dataset):
            return False
        return self.trainer.args.train_sampling_strategy != "sequential"

    # -- a run ---------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def training(self, checkpoint: StoredCheckpoint | None):
        """Around `Trainer.train`: plan (taking the checkpoint into account), log the plan, run the loop with
        accumulation 1 as the active session, then put the argument back."""
        self._timing = None
        if checkpoint is None:
            self.tokens_seen, self.last_step = 0, -1
            self.step_time = StepTimeModel()
        elif self.trainer.args.ignore_data_skip:
            raise ValueError(
                "ignore_data_skip=True makes a resumed run read its batches from the first step again, while "
                "AdaptiveBatch's step k must take the samples the plan gives step k. Resume with "
                "ignore_data_skip=False (skipping costs no data loading: only the sampler's indices are skipped)."
            )
        self.noise = self._new_noise()  # (a checkpoint's averages are read in `prepare`)
        self.prepare(checkpoint)
        if self.trainer.args.should_log:
            logger.info("%s", report.format_rows("AdaptiveBatch plan", self.plan_rows()))
            if self.config.measure_noise and not self.runner.engine.measures_noise:
                logger.info("The gradient noise scale is not measured under %s.", self.runner.engine.name)
        self._check_longest_row()
        args = self.trainer.args
        args.gradient_accumulation_steps = 1
        previous, Session.active = Session.active, self
        try:
            yield
        finally:
            Session.active = previous
            args.gradient_accumulation_steps = self.gradient_accumulation_steps
            self.runner.close()

    def _check_longest_row(self) -> None:
        """Warn before any compute when the dataset holds a row longer than the token budget (it will run alone)."""
        controller = self.controller
        if not isinstance(controller, TokenController) or getattr(self.trainer.args, "packing", False):
            return  # a packed row is cut between sequences
        longest = lengths.longest(self.trainer.train_dataset)
        if longest is not None and longest > controller.max_tokens:
            controller.warn_long_row(longest)

    def initial_training_values(self) -> tuple:
        """What `Trainer.set_initial_training_values` returns, from the plan: the loop sees one epoch of all steps.

        Data epochs are tracked by the callback (`state.epoch`, epoch-end evaluation and saving).
        """
        plan = self.plan
        return (
            1,  # num_train_epochs of the loop
            plan.num_steps,  # num_update_steps_per_epoch
            plan.dataset_size,  # num_examples
            plan.num_samples,  # num_train_samples
            plan.scheduled[plan.done_steps],  # total_train_batch_size (the first scheduled effective batch)
            plan.num_steps,  # steps_in_epoch
            plan.num_steps,  # max_steps
        )

    def train_dataloader(self) -> DataLoader:
        args = self.trainer.args
        dataset, collator = compat.train_dataset_and_collator(
            self.trainer, self.trainer.train_dataset, self.trainer.data_collator
        )
        if is_stream(dataset):  # the steps come out of the stream itself, one list of samples each
            shared = args.dataloader_num_workers == 0 and dist.is_available() and dist.is_initialized()
            dataset = self.sampler = StepStream(
                dataset, self.plan, rank=self.rank, max_steps=args.max_steps, shared=shared
            )
            params = {"batch_size": None}
        else:
            self.sampler = StepBatchSampler(
                self.plan, seed=self._data_seed(), rank=self.rank, shuffle=self._shuffle()
            )
            params = {"batch_sampler": self.sampler}
        params |= {
            "collate_fn": collator,
            "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory,
        }
        if args.dataloader_num_workers > 0:
            from transformers.trainer_utils import seed_worker

            params["persistent_workers"] = args.dataloader_persistent_workers
            params["prefetch_factor"] = args.dataloader_prefetch_factor
            params["worker_init_fn"] = _WorkerInit(seed_worker, args.dataloader_num_workers, self.rank)
        return DataLoader(dataset, **params)

    def wrap_scheduler(self, scheduler, optimizer):
        batch_changes = (
            len(set(self.plan.sizes[self.plan.done_steps :])) > 1
            or self.config.lr_scaling != "none"
            or self.growing is not None
        )
        return follow_sample_clock(scheduler, optimizer, self.clock, batch_changes)

    # -- steps ---------------------------------------------------------------------------------------------------

    def training_step(self, inner_step, model, inputs, num_items_in_batch):
        step = self.trainer.state.global_step
        self._time_step(step)
        exploring = self.controller.exploring
        split = self._split(step)
        loss = self.runner.run(
            inner_step, model, inputs, num_items_in_batch, self.plan.max_rows(step), split=split
        )
        self.tokens_seen += self.runner.last.real_tokens
        self.last_step = step
        self._average_noise(step)
        if self.growing is not None:
            last = self.runner.last
            timed = not exploring and not self.controller.exploring and not last.retries
            self._timing = (
                self._timing[0],
                (self.plan.max_rows(step), last.accumulation_steps) if timed else None,
            )
            if not split:
                self._usual_micro_batches = last.accumulation_steps
            self._maybe_grow(step)
        return loss

    # -- growing by goodput ----------------------------------------------------------------------------------------

    def _time_step(self, step: int) -> None:
        """Time the last step, from its start to this one's (its optimizer step, logging and data loading included)."""
        if self.growing is None:
            return
        now = time.perf_counter()
        if self._timing is not None and self._timing[1] is not None and step == self.last_step + 1:
            rows, micro_batches = self._timing[1]
            self.step_time.record(rows, micro_batches, now - self._timing[0])
        self._timing = (now, None)

    def _split(self, step: int) -> bool:
        """Whether to cut this step in two so that one process measures the noise scale
        (`NoiseScaleSchedule.cut_every`)."""
        schedule = self.growing
        if schedule is None or self.world_size != 1:
            return False
        every = schedule.measure_every  # (checked first: the step time model is fitted only on such steps)
        if not every or step % every != every - 1:
            return False
        return bool(
            schedule.cut_every(
                schedule(Progress(self._first_undrawn(step), 0, 0.0)),
                self.world_size,
                self.step_time,
                self._usual_micro_batches,
                self._micro_batch_cap(),
            )
        )

    def _first_undrawn(self, step: int) -> int:
        """The first step whose samples the data loader has not drawn yet, and not before the last change: where a
        change made now would take effect."""
        schedule = self.growing
        first = (self.sampler.issued if self.sampler is not None else step) + 1
        if schedule.changes:  # (a change may already wait in steps the loader has not drawn)
            first = max(first, schedule.changes[-1].step + 1)
        return first

    def _maybe_grow(self, step: int) -> None:
        """Ask the schedule, after `step`, whether a larger effective batch pays; if so, plan again from the first
        step the data loader has not drawn yet."""
        schedule, plan = self.growing, self.plan
        first = self._first_undrawn(step)
        # the size decided last: steps drawn before it took effect still run the one before
        current, samples = schedule(Progress(first, 0, 0.0)), plan.samples_before_step[step + 1]
        noise = self.noise.lower_bound(schedule.confidence_z)
        proposal = schedule.propose(
            current,
            samples,
            self.world_size,
            noise,
            self.step_time,
            self._usual_micro_batches,
            self._micro_batch_cap(),
        )
        size, reason = proposal if proposal is not None else (0, "")
        if self.runner.distributed:
            # timings differ between ranks: the largest proposal holds for all, from the latest undrawn step
            size, first = (int(x) for x in self.runner.agree([size, first]))
            if size and not reason:
                reason = "another rank's step times"
        if not size or first >= plan.num_steps:
            return
        change = schedule.change(first, size, samples, reason, self.noise.value)
        self.plan = self._build_plan(schedule)
        if self.plan.sizes[:first] != plan.sizes[:first] or self.plan.starts[:first] != plan.starts[:first]:
            raise RuntimeError("A new plan changed steps already drawn; this is a bug in AdaptiveBatch.")
        self.clock.plan = self.plan
        if self.sampler is not None:
            self.sampler.plan = self.plan
        self.identity = replace(self.identity, fingerprint=self.plan.fingerprint())
        if isinstance(self.controller, TokenController):
            self.controller.size = self._token_row_cap()
        else:
            self.controller.raise_row_limit(self.plan.max_rows_per_rank)
        self.trainer.state.max_steps = self.plan.num_steps
        if self.trainer.args.should_log:
            logger.info(
                "AdaptiveBatch: effective batch %d -> %d from step %d (after %s samples): %s; %d steps in all now.",
                current,
                size,
                first,
                f"{samples:,}",
                change.reason,
                self.plan.num_steps,
            )

    def _micro_batch_cap(self) -> int | None:
        """The most rows a micro-batch may hold at a larger step, as far as known (see `NoiseScaleSchedule.propose`)."""
        controller = self.controller
        if isinstance(controller, TokenController):
            return max(1, self.runner.last.micro_batch_size) if self._usual_micro_batches > 1 else None
        return controller.larger_step_cap()

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

    def current(self) -> dict:
        """Where the run stands after its last optimizer step (before the first: what step 0 will run)."""
        plan, controller = self.plan, self.controller
        if self.last_step < 0:
            values = {
                "effective_batch_size": plan.sizes[plan.done_steps],
                "micro_batch_size": controller.size,
                "samples_seen": plan.samples_before_step[plan.done_steps],
                "tokens_seen": self.tokens_seen,
                "lr_scale": self.clock.scale(plan.done_steps),
            }
        else:
            values = {key.split("/", 1)[1]: value for key, value in self.metrics().items()}
        values["step"] = self.last_step + 1
        values["micro_batch_settled_because"] = controller.settled_because
        values["batch_changes"] = [
            {"step": c.step, "size": c.size, "samples_seen": c.samples_seen, "reason": c.reason}
            for c in (self.growing.changes if self.growing is not None else [])
        ]
        return values

    def metrics(self) -> dict[str, float]:
        """The `adaptive_batch/*` values after the last optimizer step."""
        step = self.last_step
        last = self.runner.last
        return {
            "adaptive_batch/effective_batch_size": self.plan.sizes[step],
            "adaptive_batch/micro_batch_size": last.micro_batch_size,
            "adaptive_batch/accumulation_steps": last.accumulation_steps,
            "adaptive_batch/samples_seen": self.plan.samples_before_step[step + 1],
            "adaptive_batch/tokens_seen": self.tokens_seen,
            "adaptive_batch/lr_scale": self.clock.scale(step),
            **self.noise_metrics(),
        }

    def noise_metrics(self) -> dict[str, float]:
        """The gradient noise scale's values, once a step has measured it."""
        noise = self.noise
        if noise is None or noise.value is None:
            return {}
        return {
            "adaptive_batch/noise_scale": noise.value,
            "adaptive_batch/grad_norm_sq": noise.grad_norm_sq,
            "adaptive_batch/grad_variance": noise.grad_variance,
        }

    def add_metrics(self, logs: dict) -> None:
        if self.last_step >= 0 and self.trainer.is_in_train and "loss" in logs:
            logs.update(self.metrics())

    # -- checkpoints ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Plain JSON for the checkpoint (see `checkpoint.py`)."""
        return {
            "plan": asdict(self.identity) if self.identity else None,
            "adoption": self.adoption.to_dict() if self.adoption else None,
            "settings": asdict(self.settings),
            "tokens_seen": self.tokens_seen,
            "last_step": self.last_step,
            "micro_batch": self.controller.state_dict() if self.controller else None,
            "last_micro_batch_size": self.runner.last.micro_batch_size if self.runner else 0,
            "last_accumulation_steps": self.runner.last.accumulation_steps if self.runner else 0,
            "noise": self.noise.state_dict() if self.noise is not None else None,
            "schedule": self.growing.state_dict() if self.growing is not None else None,
            "step_time": self.step_time.state_dict() if self.growing is not None else None,
        }

    def _restore(self, checkpoint: StoredCheckpoint) -> None:
        """Counters and what the run learned, from the checkpoint, by the rules of `checkpoint.py`."""
        state = checkpoint.state
        if state is None:  # written by the plain Trainer: its steps are the plan's done steps
            self.tokens_seen, self.last_step = 0, checkpoint.global_step - 1
            logger.warning("%s", self._adoption_message(checkpoint))
            return
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.last_step = int(state.get("last_step", -1))
        self.runner.last.micro_batch_size = int(state.get("last_micro_batch_size", 0))
        self.runner.last.accumulation_steps = int(state.get("last_accumulation_steps", 0))
        stored_noise = state.get("noise")  # (none in checkpoints written before the noise scale was measured)
        if self.noise is not None and stored_noise:
            self.noise.load_state_dict(stored_noise)
        if self.growing is not None and state.get(
            "step_time"
        ):  # (the schedule's changes are read in `prepare`)
            self.step_time.load_state_dict(state["step_time"])
        applies, message = learned_state_applies(state.get("settings"), self.settings)
        learned = state.get("micro_batch")
        if applies and learned is not None and _cut_kind(learned) != _cut_kind(self.controller.state_dict()):
            # the same settings, another dataset: "auto" cut the checkpoint's run by the other unit
            applies, message = (
                False,
                (
                    f"Micro-batches: cut by {_cut_kind(self.controller.state_dict())} now; the checkpoint's run cut by "
                    f"{_cut_kind(learned)}, and what it learned is not used."
                ),
            )
        if applies and learned is not None:
            self.controller.load_state_dict(learned)
            self.controller.limit_to(self.config.max_micro_batch_size)
        logger.info("%s", message)

    def _adoption_message(self, checkpoint: StoredCheckpoint) -> str:
        plan, steps = self.plan, checkpoint.global_step
        position = plan.starts[steps] if steps < plan.num_steps else plan.budget
        samples = plan.samples_before_step[steps]
        text = (
            f"{checkpoint.path} was written without AdaptiveBatch: its {steps} steps of the plain Trainer "
            f"({samples:,} samples at an effective batch of {plan.scheduled[0]}, {position / plan.dataset_size:.3g} "
            "epochs) count as done, and training goes on from there in AdaptiveBatch's own sample order"
        )
        if position % plan.dataset_size == 0:
            return text + " (it ended on an epoch boundary, so every later epoch sees every sample once)."
        return text + (
            ", which cannot replay the plain Trainer's: the rest of this epoch may repeat some of its samples and "
            "miss others; later epochs see every sample once."
        )

    # -- logging -------------------------------------------------------------------------------------------------

    def plan_rows(self) -> list[tuple[str, str]]:
        """The plan as (label, value) rows: what the log shows when training starts."""
        config, controller, plan = self.config, self.controller, self.plan
        by_tokens = isinstance(controller, TokenController)
        plain = PlainBatching(
            plan.dataset_size,
            self.per_device_train_batch_size,
            self.gradient_accumulation_steps,
            self.world_size,
            bool(self.trainer.args.dataloader_drop_last),
        )
        args = self.trainer.args
        total_tokens = lengths.total_tokens(self.trainer.train_dataset)
        rows = report.plan_rows(
            plan,
            self.clock,
            self.budget,
            schedule_text=describe(config.resolved_schedule(self.default_effective_batch_size)),
            micro_batch_text=report.micro_batch_text(
                controller.size,
                config.auto,
                controller.exploring,
                config.growth_margin,
                config.max_micro_batch_size,
                controller.max_tokens if by_tokens else None,
                plan.max_rows_per_rank,
                by_tokens and controller.tuning,
            ),
            plain_steps=plain.total_steps(args.num_train_epochs, args.max_steps),
            tokens=None
            if total_tokens is None
            else round(total_tokens * self.budget.samples / plan.dataset_size),
            rule_text=config.lr_scaling
            if isinstance(config.lr_scaling, str)
            else describe(config.lr_scaling),
            accumulation_text=report.accumulation_text(
                plan,
                self.gradient_accumulation_steps,
                None if config.auto or by_tokens else controller.size,
                by_tokens,
            ),
        )
        if is_stream(self.trainer.train_dataset):
            stream = ("epochs", f"a stream: its first {plan.budget:,} samples, read once in order")
            rows = [stream if label == "epochs" else (label, value) for label, value in rows]
        return rows


def _cut_kind(state: dict) -> str:
    """ "tokens" or "rows": how the controller whose state this is cuts steps (states written before the token
    controller had its own class say so by their `max_tokens`)."""
    return state.get("kind") or ("tokens" if state.get("max_tokens") is not None else "rows")


def _dataset_unit(args) -> str:
    """What one row of the training dataset is, for messages: TRL's packing puts several examples in each row."""
    if getattr(args, "packing", False):
        return "packed rows (TRL's packing=True puts several of your examples into each row of max_length tokens)"
    return "samples"


class _WorkerInit:
    """Picklable `worker_init_fn` seeding dataloader workers as the Trainer does."""

    def __init__(self, seed_worker, num_workers: int, rank: int):
        self.seed_worker, self.num_workers, self.rank = seed_worker, num_workers, rank

    def __call__(self, worker_id: int) -> None:
        self.seed_worker(worker_id, num_workers=self.num_workers, rank=self.rank)
