"""Resuming: a checkpoint read before the Trainer does, a plain Trainer's taken over, what a run learned restored.
See README, "Interrupt and resume"."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict

from ..core.checkpoint import Adoption, PlanIdentity, StoredCheckpoint, check_schema, identity_error
from ..core.plain_trainer import PlainBatching, plain_resume_mismatch
from ..core.planning import RunPlan
from ..core.steps import DoneSteps, StepPlan
from ..runtime.compat.trainer import saved_callback_state

logger = logging.getLogger("adaptive_batch")

TRAINER_STATE_NAME = "trainer_state.json"  # transformers' name for the file
STATE_KEY = "AdaptiveBatch"  # the callback's class name, under which TrainerState stores its state
# the start of the key that makes a Trainer without AdaptiveBatch refuse a checkpoint (`guard_plain_resume`)
PLAIN_RESUME_KEY = "AdaptiveBatch:"


def read_checkpoint(path: str) -> StoredCheckpoint:
    """A checkpoint folder's `trainer_state.json`, read before the Trainer does so that the plan is built first."""
    file = os.path.join(path, TRAINER_STATE_NAME)
    if not os.path.isdir(path):
        # (the Trainer's own sentence first, which scripts and tests match on)
        raise ValueError(
            f"Can't find a valid checkpoint at {path}: resume_from_checkpoint={path!r} is not a folder; pass a "
            "checkpoint-N folder."
        )
    if not os.path.isfile(file):
        raise ValueError(
            f"resume_from_checkpoint={path!r} holds no {TRAINER_STATE_NAME}, so AdaptiveBatch cannot tell which "
            "samples were trained; pass a checkpoint-N folder written by Trainer.save_model or a save strategy."
        )
    with open(file, encoding="utf-8") as handle:
        trainer_state = json.load(handle)
    state = (saved_callback_state(trainer_state, STATE_KEY) or {}).get("checkpoint") or None
    if state is not None:
        check_schema(state, path)
    return StoredCheckpoint(
        path=path,
        global_step=int(trainer_state.get("global_step", 0)),
        state=state,
        train_batch_size=trainer_state.get("train_batch_size"),
    )


class Resume:
    """The checkpoint a train() resumes (`None`: a new run) and the plain Trainer's it takes over (`adoption`)."""

    def __init__(self, checkpoint: StoredCheckpoint | None, args, world_size: int, stream: bool):
        self.checkpoint, self.args = checkpoint, args
        self.adoption: Adoption | None = None
        if checkpoint is not None and checkpoint.state is not None:
            stored = checkpoint.state["adoption"]
            self.adoption = Adoption.from_dict(stored) if stored else None
        elif checkpoint is not None and checkpoint.global_step > 0:
            if stream:
                raise ValueError(
                    f"{checkpoint.path} was written by the plain Trainer, whose reading of a training stream "
                    "AdaptiveBatch cannot replay exactly. Start a new run with AdaptiveBatch, or resume without it."
                )
            self.adoption = Adoption(
                global_step=checkpoint.global_step,
                # what the plain Trainer recorded; the rest is taken from the arguments of this run
                per_device_train_batch_size=checkpoint.train_batch_size or args.per_device_train_batch_size,
                gradient_accumulation_steps=args.gradient_accumulation_steps,
                world_size=world_size,
                drop_last=bool(args.dataloader_drop_last),
            )

    def done_steps(self, dataset_size: int | None) -> DoneSteps | None:
        if self.adoption is None:
            return None
        settings = asdict(self.adoption)  # the plain Trainer's batch settings, and the step it reached
        global_step = settings.pop("global_step")
        return PlainBatching(dataset_size, **settings).done_steps(global_step)

    def check(self, identity: PlanIdentity) -> None:
        if self.checkpoint is None or self.checkpoint.state is None:
            return
        differences = identity.differences(self.checkpoint.state["plan"])
        if differences:
            raise ValueError(identity_error(differences))

    def restore(self, plan: StepPlan, shuffle: bool, status, assembly, growth) -> None:
        checkpoint, state = self.checkpoint, self.checkpoint.state
        if state is None:  # written by the plain Trainer: its steps are the plan's done steps
            status.adopt(checkpoint.global_step)
            same_order = not shuffle or bool(self.args.accelerator_config.use_seedable_sampler)
            logger.warning("%s", adoption_message(plan, checkpoint, same_order))
            return
        status.load_state_dict(state)
        if growth is not None and state["step_time"]:  # (the schedule's changes were read before planning)
            growth.step_time.load_state_dict(state["step_time"])
        assembly.load_state_dict(state)


def plain_batching(args, plan: StepPlan) -> PlainBatching:
    return PlainBatching(
        plan.dataset_size,
        args.per_device_train_batch_size,
        args.gradient_accumulation_steps,
        plan.world_size,
        bool(args.dataloader_drop_last),
    )


def adoption_message(plan, checkpoint: StoredCheckpoint, same_order: bool) -> str:
    """What taking over a plain Trainer's checkpoint means for the samples (`same_order`: the seedable sampler's)."""
    steps = checkpoint.global_step
    position = plan.starts[steps] if steps < plan.num_steps else plan.budget
    samples = plan.samples_before_step[steps]
    text = (
        f"{checkpoint.path} was written without AdaptiveBatch: its {steps} steps of the plain Trainer "
        f"({samples:,} samples at an effective batch of {plan.scheduled[0]}, {position / plan.dataset_size:.3g} "
        "epochs) count as done, and training goes on from there in AdaptiveBatch's own sample order"
    )
    if position % plan.dataset_size == 0:
        return text + " (it ended on an epoch boundary, so every later epoch sees every sample once)."
    if same_order:
        return text + (
            ", which is the plain Trainer's own (each epoch's permutation drawn as its seedable sampler draws it), "
            "so the rest of this epoch takes exactly the samples its steps had not."
        )
    return text + (
        ", which cannot replay the plain Trainer's (accelerator_config use_seedable_sampler=False): the rest of "
        "this epoch may repeat some of its samples and miss others; later epochs see every sample once."
    )


def guard_plain_resume(checkpoint_dir: str, global_step: int, run: RunPlan, args) -> None:
    """Make a Trainer without AdaptiveBatch refuse the checkpoint where it would resume at another sample or learning
    rate: a key of `trainer_state.json` that is the refusal's text, which `TrainerState(**json)` names in its error."""
    file = os.path.join(checkpoint_dir, TRAINER_STATE_NAME)
    if not os.path.isfile(file):  # (saved elsewhere: a hyperparameter search's trial folder)
        return
    plan = run.plan
    plain = plain_batching(args, plan)
    position = plan.end_position(global_step - 1) if global_step > 0 else 0
    plain_lr_steps = plain.total_steps(args.num_train_epochs, args.max_steps)
    reason = plain_resume_mismatch(plain, position, global_step, run.clock.nominal_steps, plain_lr_steps)
    if reason is None:
        return
    refusal = (
        f"{PLAIN_RESUME_KEY} a Trainer without AdaptiveBatch would resume this checkpoint at the wrong sample or "
        f"learning rate: {reason}. Resume it with callbacks=[AdaptiveBatch(...)] and this run's settings, or "
        "start a new run from its weights"
    )
    with open(file, encoding="utf-8") as handle:
        fields = json.load(handle)
    fields[refusal] = True
    with open(file, "w", encoding="utf-8") as handle:  # (as TrainerState.save_to_json writes it)
        handle.write(json.dumps(fields, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def readable_by_the_trainer(path: str | None) -> Iterator[str | None]:
    """`path`, or where it carries [`guard_plain_resume`]'s key, a temporary view of it without the key."""
    fields = {}
    if path is not None:
        with open(os.path.join(path, TRAINER_STATE_NAME), encoding="utf-8") as handle:
            fields = json.load(handle)
    if not any(key.startswith(PLAIN_RESUME_KEY) for key in fields):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="adaptive-batch-resume-") as folder:
        view = os.path.join(folder, os.path.basename(os.path.normpath(path)))
        os.mkdir(view)
        for name in os.listdir(path):
            if name != TRAINER_STATE_NAME:
                _link(os.path.abspath(os.path.join(path, name)), os.path.join(view, name))
        kept = {key: value for key, value in fields.items() if not key.startswith(PLAIN_RESUME_KEY)}
        with open(os.path.join(view, TRAINER_STATE_NAME), "w", encoding="utf-8") as handle:
            json.dump(kept, handle)
        yield view


def _link(source: str, target: str) -> None:
    try:
        os.symlink(source, target, target_is_directory=os.path.isdir(source))
    except OSError:  # where no link can be made (Windows without the privilege, some filesystems): a copy
        (shutil.copytree if os.path.isdir(source) else shutil.copy2)(source, target)
