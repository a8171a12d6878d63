"""What AdaptiveBatch keeps in a checkpoint (plain JSON in `TrainerState.stateful_callbacks`) and the rules for
resuming. See docs/how-it-works.md, "Data, cuts and measurements" (5.). Pure Python."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

SCHEMA_VERSION = 1  # the layout of the state below; raise it when a key changes meaning


def check_schema(state: dict, path: str) -> None:
    schema = state.get("schema")
    if schema != SCHEMA_VERSION:
        raise ValueError(
            f"{path} holds AdaptiveBatch state of layout {schema!r}, and this release of adaptive-batch reads layout "
            f"{SCHEMA_VERSION}. Resume it with the release that wrote it, or start a new run."
        )


@dataclass(frozen=True)
class PlanIdentity:
    """What decides which sample goes into which step, and at which learning rate: the same on resume, or refused.
    `fingerprint`, the cut of the stream into steps, is named only for a change no other field explains."""

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
    parts = [f"micro_batch_size={settings['micro_batch_size']!r}"]
    parts += [
        f"{name}={value}"
        for name, value in settings.items()
        if name != "micro_batch_size" and value is not None and value is not False
    ]
    return ", ".join(parts)


def learned_state_applies(stored: dict, now: dict) -> tuple[bool, str]:
    """Whether what a checkpoint's run learned about micro-batches applies under the settings now; the line why."""
    if stored == now:
        return True, (
            f"Micro-batches: as the run had learned them before the checkpoint ({describe_settings(now)})."
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


@dataclass(frozen=True)
class StoredCheckpoint:
    """A checkpoint's global step, AdaptiveBatch's state (`None`: a plain Trainer's) and its per-device batch."""

    path: str
    global_step: int
    state: dict | None
    train_batch_size: int | None
