"""What AdaptiveBatch keeps in a checkpoint, and the rules for resuming from one. Pure Python.

A checkpoint's `trainer_state.json` holds, under `stateful_callbacks["AdaptiveBatch"]["attributes"]["checkpoint"]`,
plain JSON:

- `plan`: what decides which sample goes where ([`PlanIdentity`]);
- `settings`: the micro-batch settings the run was started with ([`MicroBatchSettings`]);
- `micro_batch`: what the run learned (the micro-batch controller's state);
- counters: tokens seen, the last step, the last step's micro-batches.

Rules on resume:

1. The plan identity must be the same, or the resume is refused with every field that changed named: another seed
   or shuffle setting would draw samples already trained in the epoch again.
2. Micro-batch settings stated now win. What the checkpoint learned (sizes timed under `"auto"`, a size or token
   budget an out-of-memory error shrank) is used only where the settings are the ones the run was started with.
3. A checkpoint without AdaptiveBatch's state was written by the plain Trainer: its steps count as done
   ([`Adoption`]) and the plan starts where they ended in the sample stream.
"""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, dataclass, fields

TRAINER_STATE_NAME = "trainer_state.json"  # transformers' name for the file
STATE_KEY = "AdaptiveBatch"  # the callback's class name, under which TrainerState stores its state


@dataclass(frozen=True)
class PlanIdentity:
    """Everything that decides which sample goes into which step: the same on resume, or the samples change."""

    dataset_size: int
    budget_samples: int
    drop_last: bool
    data_seed: int
    shuffle: bool
    adopted_at_step: int  # steps of a plain Trainer's checkpoint the plan took over from (0: none)
    fingerprint: str  # the cut of the sample stream into steps

    def differences(self, stored: dict) -> list[str]:
        """What differs from a stored identity, one phrase per field ("seed: 0 in the checkpoint, 1 now").

        Fields a checkpoint does not hold (written by an older release) are not compared; the cut is named only
        when nothing else explains a change of it.
        """
        now = asdict(self)
        changed = [
            f"{_LABELS[name]}: {stored[name]!r} in the checkpoint, {now[name]!r} now"
            for name in now
            if name != "fingerprint" and name in stored and stored[name] != now[name]
        ]
        if not changed and stored.get("fingerprint") not in (None, self.fingerprint):
            changed.append(
                "the cut into steps (the schedule gives other effective batches, or the budget counts differently)"
            )
        return changed


_LABELS = {
    "dataset_size": "dataset size",
    "budget_samples": "budget in samples",
    "drop_last": "dataloader_drop_last",
    "data_seed": "data seed (data_seed, or seed when data_seed is not set)",
    "shuffle": "shuffled epochs (train_sampling_strategy)",
    "adopted_at_step": "steps taken over from a plain Trainer's checkpoint",
}


def identity_error(differences: list[str]) -> str:
    return (
        "The checkpoint was written under another step plan, so the samples of the steps left would not be the ones "
        f"the run has not yet seen. Changed: {'; '.join(differences)}. Resume with the checkpoint's settings, or "
        "start a new run (a new output_dir, or without resume_from_checkpoint)."
    )


@dataclass(frozen=True)
class MicroBatchSettings:
    """The micro-batch settings a user states (`AdaptiveBatch(...)`)."""

    micro_batch_size: int | str
    max_micro_batch_size: int | None
    max_tokens_per_micro_batch: int | None
    micro_batch_overhead: int | None = None  # absent from checkpoints written before it existed
    padding_free: bool = False  # likewise

    def describe(self) -> str:
        parts = [f"micro_batch_size={self.micro_batch_size!r}"]
        if self.max_micro_batch_size is not None:
            parts.append(f"max_micro_batch_size={self.max_micro_batch_size}")
        if self.max_tokens_per_micro_batch is not None:
            parts.append(f"max_tokens_per_micro_batch={self.max_tokens_per_micro_batch}")
        if self.micro_batch_overhead is not None:
            parts.append(f"micro_batch_overhead={self.micro_batch_overhead}")
        if self.padding_free:
            parts.append("padding_free=True")
        return ", ".join(parts)


def learned_state_applies(stored: dict | None, now: MicroBatchSettings) -> tuple[bool, str]:
    """Whether what a checkpoint's run learned about micro-batches applies under the settings stated now, and the
    one line that says which applies.

    It applies when the settings are the ones the run was started with, or when both runs leave the size to
    `"auto"` in the same mode (rows, or a token budget and overhead stated the same): then a new `max_micro_batch_size` caps the
    learned size. Otherwise the settings stated now win and the run starts afresh with them.
    """
    if stored is None:  # written before settings were stored: the checkpoint's state is all there is
        return True, "Micro-batches: as the run had learned them before the checkpoint."
    before = MicroBatchSettings(
        **{
            f.name: stored.get(f.name, None if f.default is MISSING else f.default)
            for f in fields(MicroBatchSettings)
        }
    )
    if before == now:
        return True, f"Micro-batches: as the run had learned them before the checkpoint ({now.describe()})."
    same_auto = (
        before.micro_batch_size == now.micro_batch_size == "auto"
        and before.max_tokens_per_micro_batch == now.max_tokens_per_micro_batch
        and before.micro_batch_overhead == now.micro_batch_overhead
        and before.padding_free == now.padding_free
    )
    if same_auto:
        return True, (
            f"Micro-batches: as the run had learned them before the checkpoint, within {now.describe()} as set now "
            f"(the checkpoint's run: {before.describe()})."
        )
    return False, (
        f"Micro-batches: {now.describe()} as set now; the checkpoint's run had {before.describe()}, and what it "
        "learned under those settings is not used."
    )


@dataclass(frozen=True)
class Adoption:
    """The plain Trainer's batch settings and the step of its checkpoint, from which AdaptiveBatch took over."""

    global_step: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    drop_last: bool

    @classmethod
    def from_dict(cls, data: dict) -> Adoption:
        return cls(**{f.name: data[f.name] for f in fields(cls)})

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class StoredCheckpoint:
    """What a checkpoint holds for AdaptiveBatch: its global step and AdaptiveBatch's own state (`None` when the
    plain Trainer wrote it), and the per-device batch size the Trainer recorded."""

    path: str
    global_step: int
    state: dict | None
    train_batch_size: int | None


def read_checkpoint(path: str) -> StoredCheckpoint:
    """Read a checkpoint folder's `trainer_state.json` (before the Trainer does, so the plan can be built first).

    Raises:
        ValueError: if the folder has no `trainer_state.json`.
    """
    file = os.path.join(path, TRAINER_STATE_NAME)
    if not os.path.isdir(path):
        raise ValueError(f"resume_from_checkpoint={path!r} is not a folder; pass a checkpoint-N folder.")
    if not os.path.isfile(file):
        raise ValueError(
            f"resume_from_checkpoint={path!r} holds no {TRAINER_STATE_NAME}, so AdaptiveBatch cannot tell which "
            "samples were trained; pass a checkpoint-N folder written by Trainer.save_model or a save strategy."
        )
    with open(file) as handle:
        trainer_state = json.load(handle)
    entry = (trainer_state.get("stateful_callbacks") or {}).get(STATE_KEY)
    if isinstance(
        entry, list
    ):  # several callbacks of one class are stored as a list; one AdaptiveBatch at most
        entry = entry[0] if entry else None
    state = entry.get("attributes", {}).get("checkpoint") if isinstance(entry, dict) else None
    return StoredCheckpoint(
        path=path,
        global_step=int(trainer_state.get("global_step", 0)),
        state=state or None,
        train_batch_size=trainer_state.get("train_batch_size"),
    )
