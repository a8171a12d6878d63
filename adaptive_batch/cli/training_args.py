"""The run's settings that `adaptive-batch plan` reads from the run's own TrainingArguments: a JSON of them, a
checkpoint's `training_args.bin`, or the script's command line after `--`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# the plan's flags, the TrainingArguments field each reads from --args, and its default without either
FIELDS = (
    ("per_device", "per_device_train_batch_size", 8),
    ("accumulation", "gradient_accumulation_steps", 1),
    ("epochs", "num_train_epochs", None),
    ("max_steps", "max_steps", -1),
    ("drop_last", "dataloader_drop_last", False),
)


def apply_training_args(options: argparse.Namespace) -> None:
    """Fill the plan's settings left unset on the command line from the script's arguments (after --), then from
    --args, then from the defaults."""
    fields = read_training_args(options.args) if options.args is not None else {}
    fields.update(read_script_args(getattr(options, "script_args", None) or []))
    for flag, field, default in FIELDS:
        given = getattr(options, flag)
        if given is None or (flag == "drop_last" and not given):
            setattr(options, flag, fields.get(field, default))


def read_training_args(path: Path) -> dict:
    """The fields of a saved TrainingArguments: a JSON object of them, or a `training_args.bin`."""
    if not path.exists():
        raise ValueError(
            f"--args {path} does not exist; pass a TrainingArguments JSON or a training_args.bin."
        )
    if path.suffix == ".bin":
        import torch

        saved = torch.load(path, weights_only=False)  # a pickled TrainingArguments, the Trainer's own format
        fields = saved.to_dict() if hasattr(saved, "to_dict") else None
    else:
        try:
            fields = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(
                f"--args {path} is not JSON ({error}); pass args.to_json_string() saved to a file."
            ) from None
    if not isinstance(fields, dict) or "per_device_train_batch_size" not in fields:
        raise ValueError(
            f"--args {path} holds no TrainingArguments (no per_device_train_batch_size); save them with "
            "open(path, 'w').write(args.to_json_string()), or pass a checkpoint's training_args.bin."
        )
    return fields


def read_script_args(argv: list[str]) -> dict:
    """The TrainingArguments fields the plan reads, from a script's command line as HfArgumentParser takes it
    (`--per_device_train_batch_size 4` or `--per-device-train-batch-size=4`, a bool as a bare flag or with a
    value); every other argument is ignored."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    types = {"per_device_train_batch_size": int, "gradient_accumulation_steps": int, "max_steps": int}
    for _, field, _ in FIELDS:
        names = [f"--{field}", f"--{field.replace('_', '-')}"]
        if field == "dataloader_drop_last":
            parser.add_argument(*names, dest=field, nargs="?", const="true", type=str)
        else:
            parser.add_argument(*names, dest=field, type=types.get(field, float))
    try:
        known, _ = parser.parse_known_args(argv)
    except SystemExit:
        field_names = ", ".join(field for _, field, _ in FIELDS)
        raise ValueError(
            f"The script arguments {' '.join(argv)!r} give one of {field_names} no valid value."
        ) from None
    fields = {field: value for field, value in vars(known).items() if value is not None}
    if "dataloader_drop_last" in fields:
        fields["dataloader_drop_last"] = fields["dataloader_drop_last"].lower() in ("true", "1", "yes")
    return fields
