"""The TrainingArguments that `adaptive-batch plan` reads: a JSON of them, a checkpoint's `training_args.bin`, or
the script's command line after `--`. See docs/how-it-works.md, "The commands"."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from pathlib import Path

from . import sft_args
from .sft_args import BOOLEANS

# the plan's flags, the TrainingArguments field each reads from --args, its default without either, an example and
# the rule its value follows
FIELDS = (
    ("per_device", "per_device_train_batch_size", 8, 8, "a positive int"),
    ("accumulation", "gradient_accumulation_steps", 1, 4, "a positive int"),
    ("epochs", "num_train_epochs", None, 3, "a number >= 0 (0 only with max_steps)"),
    ("max_steps", "max_steps", -1, 500, "an int (-1: not set)"),
    ("drop_last", "dataloader_drop_last", False, "false", "true or false"),
)


def apply_training_args(options: argparse.Namespace) -> None:
    """Fill the plan's settings left unset by its flags from the script's arguments (after --), then from --args, then
    from the defaults, each checked; `options.given` says where each flag not defaulted came from."""
    options.script_fields = script_fields(options.script_args)
    # as HfArgumentParser takes them; a value that is not a number (or a bool) kept as given, to be refused below
    script = {field: _script_value(field, text) for field, text in options.script_fields.items()}
    sources = [("script", "the script arguments after -- give", script)]
    options.saved_args = None
    if options.args is not None:
        options.saved_args = read_training_args(options.args)
        sources.append(("args", f"--args {options.args} gives", options.saved_args))
    options.given = {}
    for flag, field, default, example, rule in FIELDS:
        given = getattr(options, flag)
        if given is not None and not (flag == "drop_last" and not given):
            options.given[flag] = "flag"
            continue
        value = default
        for source, where, fields in sources:
            if field in fields:
                value = _valid(field, fields[field])
                if value is None:
                    fix = f'"{field}": {example}' if where.startswith("--args") else f"--{field} {example}"
                    raise ValueError(
                        f"{where} {field}={fields[field]!r}, which is not {rule}; use e.g. {fix}, or override it with "
                        f"--{flag.replace('_', '-')} {example if flag != 'drop_last' else ''}".rstrip()
                        + "."
                    )
                options.given[flag] = source
                break
        setattr(options, flag, value)


def _valid(field: str, value):
    """`value` as the plan takes it where valid for `field`, else `None`."""
    if field == "dataloader_drop_last":
        return value if isinstance(value, bool) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    if field == "num_train_epochs":
        return float(value) if value >= 0 else None
    if not float(value).is_integer():
        return None
    return int(value) if field == "max_steps" or value >= 1 else None


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
        if isinstance(fields, dict) and "eos_token" in fields:  # to_dict writes '<EOS_TOKEN>' for any value
            fields["eos_token"] = getattr(saved, "eos_token", None)
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


def script_fields(argv: list[str]) -> dict[str, str]:
    """The text of each field plan reads among a script's arguments, HfArgumentParser style (a bare bool: 'true')."""
    parser = _ScriptParser(add_help=False, allow_abbrev=False)
    switches = {"dataloader_drop_last", *sft_args.BOOLEAN_FIELDS, *sft_args.EVAL_ONLY}
    for field in (*(row[1] for row in FIELDS), *sft_args.FIELDS, *sft_args.EVAL_ONLY):
        switch = {"nargs": "?", "const": "true"} if field in switches else {}
        parser.add_argument(f"--{field}", f"--{field.replace('_', '-')}", dest=field, **switch)
    known, _ = parser.parse_known_args(argv)
    return {field: text for field, text in vars(known).items() if text is not None}


class _ScriptParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ValueError(f"The script arguments after -- are not valid: {message}.")


def _script_value(field: str, text: str):
    """A script argument's text as the value HfArgumentParser would give it (the text itself where it gives none)."""
    if field == "dataloader_drop_last":
        return BOOLEANS.get(text.lower(), text)
    for kind in (int, float):
        with contextlib.suppress(ValueError):
            return kind(text)
    return text
