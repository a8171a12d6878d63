"""What AdaptiveBatch keeps in a checkpoint, and the rules for resuming from one. Pure Python.

A checkpoint holds AdaptiveBatch's state as plain JSON, in the Trainer's own `TrainerState.stateful_callbacks`:

- `schema`: the layout's version ([`SCHEMA_VERSION`]); a checkpoint of another layout is refused by name;
- `plan`: what decides which sample goes where, and the learning rate of each step ([`PlanIdentity`]);
- `settings`: the micro-batch settings the run was started with (`AdaptiveBatchConfig.micro_batch_settings`);
- `micro_batch`: what the run learned (the controller's state);
- counters: tokens seen, the last step, the last step's micro-batches; the noise scale's averages and a growing
  schedule's changes.

Rules on resume:

1. The plan identity must be the same, or the resume is refused with every field that changed named, with its value
   in the checkpoint and now: another seed or shuffle setting would draw samples already trained in the epoch again,
   and another schedule or LR rule (`lr_scaling`) would give the steps left other sizes or learning rates than the
   uninterrupted run. A growing schedule is compared by its settings: the changes it made are the checkpoint's,
   restored with it.
2. Micro-batch settings stated now win. What the checkpoint learned (sizes timed under `"auto"`, a size or token
   budget an out-of-memory error shrank) is used only where the settings are the ones the run was started with.
3. A checkpoint without AdaptiveBatch's state was written by the plain Trainer: its steps count as done
   ([`Adoption`]) and the plan starts where they ended in the sample stream.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

SCHEMA_VERSION = 1  # the layout of the state below; raise it when a key changes meaning


def check_schema(state: dict, path: str) -> None:
    """Refuse a checkpoint whose AdaptiveBatch state has another layout than this release writes."""
    schema = state.get("schema")
    if schema != SCHEMA_VERSION:
        raise ValueError(
            f"{path} holds AdaptiveBatch state of layout {schema!r}, and this release of adaptive-batch reads layout "
            f"{SCHEMA_VERSION}. Resume it with the release that wrote it, or start a new run."
        )


@dataclass(frozen=True)
class PlanIdentity:
    """Everything that decides which sample goes into which step, and at which learning rate: the same on resume, or
    the steps left change.

    Attributes:
        schedule: the schedule as the plan table describes it (`core.schedule.describe`); a `NoiseScaleSchedule` by
            its settings, not by the changes it made (those are restored from the checkpoint).
        lr_scaling: the LR rule's name (`"sqrt"`, ...), or a callable rule's description.
        fingerprint: the cut of the sample stream into steps, named only for a change no other field explains (a
            callable schedule that gives other sizes under the same description).
    """

    dataset_size: int
    budget_samples: int
    drop_last: bool
    data_seed: int
    shuffle: bool
    adopted_at_step: int  # steps of a plain Trainer's checkpoint the plan took over from (0: none)
    schedule: str
    lr_scaling: str
    fingerprint: str

    def differences(self, stored: dict) -> list[str]:
        """What differs from a stored identity, one phrase per field ("seed: 0 in the checkpoint, 1 now"); the cut
        is named only when nothing else explains a change of it."""
        now = asdict(self)
        changed = [
            f"{_LABELS[name]}: {stored[name]!r} in the checkpoint, {now[name]!r} now"
            for name in now
            if name != "fingerprint" and stored[name] != now[name]
        ]
        if not changed and stored["fingerprint"] != self.fingerprint:
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
    "schedule": "schedule",
    "lr_scaling": "lr_scaling",
}


def identity_error(differences: list[str]) -> str:
    return (
        "The checkpoint was written under another step plan, so the steps left would not take the samples the run "
        "has not yet seen, or not at the learning rates the uninterrupted run would give them. Changed: "
        f"{'; '.join(differences)}. Resume with the checkpoint's settings, or start a new run (a new output_dir, or "
        "without resume_from_checkpoint)."
    )


def describe_settings(settings: dict) -> str:
    """Micro-batch settings as `name=value` (the ones left at `None` or `False` are not named)."""
    parts = [f"micro_batch_size={settings['micro_batch_size']!r}"]
    parts += [
        f"{name}={value}"
        for name, value in settings.items()
        if name != "micro_batch_size" and value is not None and value is not False
    ]
    return ", ".join(parts)


def learned_state_applies(stored: dict, now: dict) -> tuple[bool, str]:
    """Whether what a checkpoint's run learned about micro-batches applies under the settings stated now, and the
    one line that says which applies.

    It applies when the settings are the ones the run was started with, or when both runs leave the size to
    `"auto"` in the same mode (rows, or a token budget and overhead stated the same): then a new
    `max_micro_batch_size` caps the learned size. Otherwise the settings stated now win and the run starts afresh
    with them.
    """
    if stored == now:
        return (
            True,
            f"Micro-batches: as the run had learned them before the checkpoint ({describe_settings(now)}).",
        )
    same_auto = stored["micro_batch_size"] == now["micro_batch_size"] == "auto" and all(
        stored[name] == now[name] for name in now if name not in ("micro_batch_size", "max_micro_batch_size")
    )
    if same_auto:
        return True, (
            f"Micro-batches: as the run had learned them before the checkpoint, within {describe_settings(now)} as "
            f"set now (the checkpoint's run: {describe_settings(stored)})."
        )
    return False, (
        f"Micro-batches: {describe_settings(now)} as set now; the checkpoint's run had {describe_settings(stored)}, "
        "and what it learned under those settings is not used."
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
