"""Wiring into `transformers.Trainer` (and subclasses such as TRL's SFTTrainer).

The Trainer instance gets a subclass of its own class with a few methods overridden (`AdaptiveTrainerMixin`):

- `train`: builds the step plan, then runs the Trainer's own loop with gradient accumulation 1;
- `get_train_dataloader`: one batch per optimizer step per rank, from a [`StepBatchSampler`];
- `set_initial_training_values`: the loop's step count, epochs and samples come from the plan;
- `create_scheduler`: the user's scheduler, built for the budget in steps of the starting batch, then driven by
  the sample clock and the LR rule;
- `training_step`: cuts the step batch into micro-batches, each through the user's class's `training_step`;
- `log`: adds the `adaptive_batch/*` metrics to every training log;
- `_load_callback_state`: restores AdaptiveBatch's own checkpoint state on resume.

Everything else (evaluation, checkpoints, callbacks, mixed precision, DDP wrapping) is the Trainer's own.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import TYPE_CHECKING

from torch.utils.data import DataLoader, IterableDataset
from transformers import Trainer

from . import lengths, report
from .config import AdaptiveBatchConfig
from .lr import SampleClock, nominal_steps
from .memory import memory_limit
from .microbatch import MicroBatchController
from .plan import Budget, StepPlan, build_plan
from .sampler import StepBatchSampler
from .schedule import Progress, check_effective_batch_size, describe
from .scheduler import follow_sample_clock
from .step import MicroBatchRunner

if TYPE_CHECKING:
    from .callback import AdaptiveBatch

logger = logging.getLogger("adaptive_batch")

STATE_KEY = "AdaptiveBatch"  # the callback's class name, under which TrainerState stores its state


class AdaptiveTrainerMixin:
    """Placed in front of the user's Trainer class; see the module docstring."""

    _adaptive_batch: Session

    def train(self, *args, **kwargs):
        with self._adaptive_batch.training():
            return super().train(*args, **kwargs)

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
        self._adaptive_batch.restore(stored)
        try:  # other callbacks restore as usual; ours keeps its live objects instead of being re-created
            return super()._load_callback_state()
        finally:
            if stored is not None:
                self.state.stateful_callbacks[STATE_KEY] = stored


_CLASSES: dict[type, type] = {}


def install(trainer: Trainer, callback: AdaptiveBatch) -> Session:
    """Check the Trainer's setup, then swap its class for one with `AdaptiveTrainerMixin` in front."""
    if isinstance(trainer, AdaptiveTrainerMixin):
        raise ValueError(
            "This Trainer already has an AdaptiveBatch attached; pass AdaptiveBatch() once, either in "
            "callbacks=[...] or through AdaptiveBatch.attach(trainer), not both."
        )
    check_trainer(trainer)
    _configure_logger(trainer.args)
    session = Session(trainer, callback.config)
    cls = type(trainer)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"AdaptiveBatch{cls.__name__}", (AdaptiveTrainerMixin, cls), {})
    trainer.__class__ = _CLASSES[cls]
    trainer._adaptive_batch = session
    if trainer.train_dataset is not None:
        session.prepare()  # bad schedules and sizes fail here, before any compute
    return session


def check_trainer(trainer: Trainer) -> None:
    """Raise, before any compute, for setups whose batches AdaptiveBatch cannot keep exact."""
    args = trainer.args
    if args.auto_find_batch_size:
        raise ValueError(
            "auto_find_batch_size=True restarts the training loop on OOM and silently changes the effective batch; "
            "AdaptiveBatch finds the micro-batch inside each step and keeps the effective batch. Set "
            "auto_find_batch_size=False."
        )
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise ValueError(
            "DeepSpeed runs its own gradient accumulation, which AdaptiveBatch does not drive yet. Remove the "
            "deepspeed config, or remove AdaptiveBatch and set the batch sizes by hand."
        )
    if getattr(trainer, "is_fsdp_enabled", False):
        raise ValueError(
            "FSDP needs a reduce-scatter of gradients that AdaptiveBatch does not do yet. Use DDP (torchrun without "
            "fsdp), or remove AdaptiveBatch."
        )
    parallelism = getattr(trainer.accelerator, "parallelism_config", None)
    if parallelism is not None and getattr(parallelism, "non_data_parallel_size", 1) > 1:
        raise ValueError(
            "Tensor, context or sequence parallelism give ranks the same samples; AdaptiveBatch splits samples "
            "across all ranks. Use data parallelism only, or remove AdaptiveBatch."
        )
    if args.n_gpu > 1:
        raise ValueError(
            f"{args.n_gpu} GPUs in one process (torch.nn.DataParallel) are not supported: launch one process per "
            "GPU with torchrun or accelerate launch, or set CUDA_VISIBLE_DEVICES to one GPU."
        )
    accelerator_config = args.accelerator_config
    if getattr(accelerator_config, "dispatch_batches", None) or getattr(
        accelerator_config, "split_batches", False
    ):
        raise ValueError(
            "accelerator_config dispatch_batches/split_batches change who loads which samples; AdaptiveBatch gives "
            "every rank its own share of each step. Leave both unset."
        )
    if args.train_sampling_strategy not in ("random", "sequential"):
        raise ValueError(
            f"train_sampling_strategy={args.train_sampling_strategy!r}: AdaptiveBatch orders samples itself and "
            "groups each step's samples by length before cutting micro-batches. Use 'random' (or 'sequential')."
        )
    for method in ("get_train_dataloader", "_get_train_sampler"):
        owner = next(c for c in type(trainer).__mro__ if method in vars(c) and c is not AdaptiveTrainerMixin)
        if owner is not Trainer:
            raise ValueError(
                f"{owner.__name__} overrides {method}, which AdaptiveBatch replaces with its step sampler, so your "
                "version would be skipped. Move that logic into the dataset or data collator, or remove AdaptiveBatch."
            )
    if _padding_free(trainer):
        raise ValueError(
            "The data collator flattens each batch into one padding-free row, which AdaptiveBatch cannot cut into "
            "micro-batches by rows. Turn padding-free collation off (TRL: SFTConfig(padding_free=False) and, with "
            "packing=True, packing_strategy='wrapped'; transformers: a padding collator instead of "
            "DataCollatorWithFlattening)."
        )
    dataset = trainer.train_dataset
    if dataset is not None and (isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__")):
        raise ValueError(
            f"The training dataset ({type(dataset).__name__}) has no length, so it has no epochs to plan steps "
            "over and no random access to draw a step's samples from. Use a map-style dataset (datasets.Dataset "
            "or a torch Dataset with __len__ and __getitem__)."
        )


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


def _padding_free(trainer: Trainer) -> bool:
    from transformers import DataCollatorWithFlattening

    collator = trainer.data_collator
    return (
        isinstance(collator, DataCollatorWithFlattening)
        or bool(getattr(collator, "padding_free", False))
        or bool(getattr(trainer, "padding_free", False))  # TRL's SFTTrainer, packing with 'bfd' included
    )


class Session:
    """AdaptiveBatch's state for one Trainer: the user's batch settings, the plan, the clock, the micro-batches."""

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
        self.controller: MicroBatchController | None = None
        self.runner: MicroBatchRunner | None = None
        self.tokens_seen = 0
        self.last_step = -1

    # -- planning ------------------------------------------------------------------------------------------------

    @property
    def default_effective_batch_size(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size

    def prepare(self) -> None:
        """Build the plan, the clock and the micro-batch controller from the current arguments and dataset."""
        trainer, config, args = self.trainer, self.config, self.trainer.args
        dataset = trainer.train_dataset
        if dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        check_trainer(trainer)
        schedule = config.resolved_schedule(self.default_effective_batch_size)
        starting = check_effective_batch_size(schedule(Progress(0, 0, 0.0)), where="The schedule at step 0")
        if args.max_steps > 0:
            self.budget = Budget.from_max_steps(args.max_steps, starting)
        else:
            self.budget = Budget.from_epochs(args.num_train_epochs, len(dataset))
        self.plan = build_plan(
            schedule, len(dataset), self.budget, self.world_size, args.dataloader_drop_last
        )
        self.clock = SampleClock(
            self.plan, config.rule, starting, nominal_steps(self.budget.samples, starting)
        )
        self.clock.check()
        by_tokens = config.max_tokens_per_micro_batch is not None
        if self.controller is None:  # built once: a second train() keeps what the first one learned
            if not config.auto:
                start = config.micro_batch_size
            else:  # with a token budget the start is the row cap: "auto" caps rows only by max_micro_batch_size
                start = self.plan.max_rows_per_rank if by_tokens else self._probed_start()
            self.controller = MicroBatchController(
                start,
                auto=config.auto,
                max_size=config.max_micro_batch_size,
                row_limit=self.plan.max_rows_per_rank,
                growth_margin=config.growth_margin,
                memory_limit=memory_limit(args.device, config.memory_headroom),
                max_tokens=config.max_tokens_per_micro_batch,
            )
        self.controller.row_limit = self.plan.max_rows_per_rank
        if by_tokens and config.auto:  # no row cap but max_micro_batch_size, under a plan that may be new
            self.controller.size = min(config.max_micro_batch_size or math.inf, self.plan.max_rows_per_rank)
        self.runner = MicroBatchRunner(trainer, self.controller, self.world_size)

    def _probed_start(self) -> int:
        """Where 'auto' starts: a cached `adaptive-batch probe` result for this setup, else the per-device size."""
        from .probe import cached_micro_batch_size, describe_setup

        trainer, args = self.trainer, self.trainer.args
        seq_len = getattr(args, "max_length", None) or lengths.longest(trainer.train_dataset)
        if seq_len is None or not hasattr(trainer.model, "config"):
            return self.per_device_train_batch_size
        setup = describe_setup(trainer.model, args.optim, bool(args.gradient_checkpointing))
        cached = cached_micro_batch_size(setup, seq_len)
        if cached is None:
            return self.per_device_train_batch_size
        size, probed_length = cached
        logger.info(
            "Starting the micro-batch at %d: adaptive-batch probe's choice at %d tokens.", size, probed_length
        )
        return size

    @contextlib.contextmanager
    def training(self):
        """Around `Trainer.train`: plan, log the plan, run the loop with accumulation 1, restore the argument."""
        self.prepare()
        self.tokens_seen, self.last_step = 0, -1  # a resumed run restores both from the checkpoint
        if self.trainer.args.should_log:
            self._log_plan()
        self._check_longest_row()
        args = self.trainer.args
        args.gradient_accumulation_steps = 1
        try:
            yield
        finally:
            args.gradient_accumulation_steps = self.gradient_accumulation_steps

    def _check_longest_row(self) -> None:
        """Warn before any compute when the dataset holds a row longer than the token budget (it will run alone)."""
        budget = self.controller.max_tokens
        longest = lengths.longest(self.trainer.train_dataset) if budget is not None else None
        if longest is not None and longest > budget:
            self.runner.warn_long_row(longest)

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
            plan.scheduled[0],  # total_train_batch_size (the starting effective batch)
            plan.num_steps,  # steps_in_epoch
            plan.num_steps,  # max_steps
        )

    def train_dataloader(self) -> DataLoader:
        trainer, args = self.trainer, self.trainer.args
        seed = args.data_seed if args.data_seed is not None else args.seed
        sampler = StepBatchSampler(
            self.plan, seed=seed, rank=self.rank, shuffle=args.train_sampling_strategy != "sequential"
        )
        dataset, collator = trainer.train_dataset, trainer.data_collator
        if lengths.is_hf_dataset(dataset):
            dataset = trainer._remove_unused_columns(dataset, description="training")
        else:
            collator = trainer._get_collator_with_removed_columns(collator, description="training")
        params = {
            "batch_sampler": sampler,
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
        batch_changes = len(self.plan.phases()) > 1 or self.config.lr_scaling != "none"
        return follow_sample_clock(scheduler, optimizer, self.clock, batch_changes)

    # -- steps ---------------------------------------------------------------------------------------------------

    def training_step(self, inner_step, model, inputs, num_items_in_batch):
        step = self.trainer.state.global_step
        loss = self.runner.run(inner_step, model, inputs, num_items_in_batch, self.plan.max_rows(step))
        self.tokens_seen += self.runner.last.real_tokens
        self.last_step = step
        return loss

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
        }

    def add_metrics(self, logs: dict) -> None:
        if self.last_step >= 0 and self.trainer.is_in_train and "loss" in logs:
            logs.update(self.metrics())

    # -- checkpoints ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "plan_fingerprint": self.plan.fingerprint() if self.plan else None,
            "tokens_seen": self.tokens_seen,
            "last_step": self.last_step,
            "micro_batch": self.controller.state_dict() if self.controller else None,
            "last_micro_batch_size": self.runner.last.micro_batch_size if self.runner else 0,
            "last_accumulation_steps": self.runner.last.accumulation_steps if self.runner else 0,
        }

    def restore(self, stored: dict | None) -> None:
        """Load the state saved in a checkpoint's `trainer_state.json` (our entry of `stateful_callbacks`)."""
        if stored is None:
            logger.warning(
                "The checkpoint holds no AdaptiveBatch state (it was written without AdaptiveBatch): training goes "
                "on from step %d of AdaptiveBatch's own plan, whose sample order is not the plain Trainer's, and "
                "the micro-batch search starts afresh.",
                self.trainer.state.global_step,
            )
            return
        state = stored.get("attributes", {}).get("checkpoint", {})
        if state.get("plan_fingerprint") not in (None, self.plan.fingerprint()):
            raise ValueError(
                "The checkpoint was written under a different step plan (schedule, dataset size, budget, "
                "drop_last or seed changed), so its samples and learning rates would not continue where they "
                "stopped. Resume with the same AdaptiveBatch schedule and TrainingArguments, or start a new run."
            )
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.last_step = int(state.get("last_step", -1))
        if state.get("micro_batch") is not None:
            self.controller.load_state_dict(state["micro_batch"])
        self.runner.last.micro_batch_size = int(state.get("last_micro_batch_size", 0))
        self.runner.last.accumulation_steps = int(state.get("last_accumulation_steps", 0))

    # -- logging -------------------------------------------------------------------------------------------------

    def _log_plan(self) -> None:
        config = self.config
        rows = report.plan_rows(
            self.plan,
            self.clock,
            self.budget,
            schedule_text=describe(config.resolved_schedule(self.default_effective_batch_size)),
            micro_batch_text=self._micro_batch_text(),
            plain_steps=self._plain_trainer_steps(),
            tokens=self._budget_tokens(),
            rule_text=config.lr_scaling
            if isinstance(config.lr_scaling, str)
            else describe(config.lr_scaling),
            accumulation_text=self._accumulation_text(),
        )
        logger.info("%s", report.format_rows("AdaptiveBatch plan", rows))

    def _micro_batch_text(self) -> str:
        config, controller = self.config, self.controller
        if controller.max_tokens is not None:
            text = f"cut by a token budget of {controller.max_tokens:,} padded tokens (rows x padded length)"
            if controller.size < self.plan.max_rows_per_rank:
                text += f", at most {controller.size} rows"
            return text + "; the budget halves and the step retries on out-of-memory"
        micro = (
            f"auto: starts at {controller.size}, doubles while tokens/s gain > {config.growth_margin:.0%}"
            if config.auto and controller.exploring
            else f"{controller.size}" + ("" if config.auto else " (fixed)")
        )
        if config.max_micro_batch_size:
            micro += f", at most {config.max_micro_batch_size}"
        return micro + "; shrinks and retries the step on out-of-memory"

    def _budget_tokens(self) -> int | None:
        """Tokens the budget covers, when the dataset's token counts can be read cheaply."""
        total = lengths.total_tokens(self.trainer.train_dataset)
        if total is None:
            return None
        return round(total * self.budget.samples / len(self.trainer.train_dataset))

    def _accumulation_text(self) -> str:
        """Micro-batches per step: known now for a fixed size, decided while training for 'auto' or a token budget."""
        if self.controller.max_tokens is not None:
            return f"as many as the rows' lengths need (the user's: {self.gradient_accumulation_steps})"
        if self.config.auto:
            return f"samples per rank per step / micro-batch (the user's: {self.gradient_accumulation_steps})"
        size = self.controller.size
        counts = sorted(
            {math.ceil(effective // self.world_size / size) for _, _, effective in self.plan.phases()}
        )
        return " -> ".join(map(str, counts)) + f" micro-batches of at most {size}"

    def _plain_trainer_steps(self) -> int:
        """Optimizer steps the plain Trainer would run with the user's settings, to show what changed."""
        args = self.trainer.args
        if args.max_steps > 0:
            return args.max_steps
        per_rank = math.ceil(len(self.trainer.train_dataset) / self.world_size)
        batches = (
            per_rank // self.per_device_train_batch_size
            if args.dataloader_drop_last
            else math.ceil(per_rank / self.per_device_train_batch_size)
        )
        return math.ceil(
            args.num_train_epochs * max(1, math.ceil(batches / self.gradient_accumulation_steps))
        )


class _WorkerInit:
    """Picklable `worker_init_fn` seeding dataloader workers as the Trainer does."""

    def __init__(self, seed_worker, num_workers: int, rank: int):
        self.seed_worker, self.num_workers, self.rank = seed_worker, num_workers, rank

    def __call__(self, worker_id: int) -> None:
        self.seed_worker(worker_id, num_workers=self.num_workers, rank=self.rank)


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
