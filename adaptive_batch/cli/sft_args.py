"""The SFTConfig fields that change the rows or tokens SFTTrainer trains on, read by `adaptive-batch plan` from the
script's arguments after `--` and `--args` and checked as TRL takes them. See docs/how-it-works.md, "The commands"."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json

# the fields of SFTConfig (and the one of TrainingArguments) that change the train set's rows or tokens, each with
# the rule its value must follow; the plan prepares the dataset as SFTTrainer does with them
FIELDS = {
    "max_length": "a positive int or None",
    "truncation_mode": "'keep_start' or 'keep_end'",
    "packing": "true or false",
    "packing_strategy": "'bfd', 'bfd_split' or 'wrapped'",
    "padding_free": "true or false",
    "dataset_text_field": "a column name",
    "completion_only_loss": "true, false or None",
    "assistant_only_loss": "true or false",
    "shuffle_dataset": "true or false",
    "seed": "an int",
    "eos_token": "a token or None",
    "chat_template_path": "a path or None",
    "dataset_kwargs": "a dict or None",
    "dataset_num_proc": "a positive int or None",
}
BOOLEAN_FIELDS = {"packing", "padding_free", "assistant_only_loss", "shuffle_dataset", "completion_only_loss"}
CHOICES = {
    "truncation_mode": ("keep_start", "keep_end"),
    "packing_strategy": ("bfd", "bfd_split", "wrapped", "bfd-requeue"),  # bfd-requeue: bfd_split's old name
}
# fields read elsewhere, or that change no train row or token: the plan does not need them
EVAL_ONLY = {"eval_packing"}
# a bool's texts as HfArgumentParser's string_to_bool takes them
BOOLEANS = dict(zip("true t yes y 1 false f no n 0".split(), [True] * 5 + [False] * 5))


@dataclasses.dataclass
class SFTArgs:
    """The SFT fields given (by the script's arguments, else by --args), whether the run is an SFTTrainer run, the
    options after -- that are no field at all, and the installed SFTConfig's defaults (`None` without TRL)."""

    given: dict = dataclasses.field(default_factory=dict)
    is_sft: bool = False
    unknown_options: list = dataclasses.field(default_factory=list)
    # where --args holds eos_token as the '<EOS_TOKEN>' to_dict writes for any value
    hidden_eos_token: str = ""
    eval_only: dict = dataclasses.field(default_factory=dict)
    defaults: dict | None = None

    def changed(self, leave_out: tuple[str, ...] = ("seed",)) -> str:
        """The given fields but `leave_out` not at SFTConfig's default (all without TRL): "max_length=128, ..."."""
        return ", ".join(
            f"{name}={value!r}"
            for name, value in self.given.items()
            if name not in leave_out and (self.defaults is None or self.defaults.get(name) != value)
        )

    def config(self) -> argparse.Namespace:
        """The SFTConfig's fields as the run has them: SFTConfig's defaults, overridden by the given ones."""
        fields = {**self.defaults, **self.given}
        if fields.get("packing_strategy") == "bfd-requeue":  # as SFTConfig.__post_init__ renames it
            fields["packing_strategy"] = "bfd_split"
        return argparse.Namespace(**fields)


def sft_defaults() -> dict | None:
    """Every field of the installed TRL's SFTConfig at its default, without building one (its `__post_init__`
    checks devices and mixed precision, which the plan does not need); `None` without TRL."""
    try:
        from trl import SFTConfig
    except ImportError:
        return None
    fields, missing = dataclasses.fields(SFTConfig), dataclasses.MISSING
    defaults = {field.name: None if field.default is missing else field.default for field in fields}
    defaults.update({f.name: f.default_factory() for f in fields if f.default_factory is not missing})
    return defaults


def read_sft_args(options: argparse.Namespace) -> SFTArgs:
    """The SFT fields of the script's arguments (first) and of --args, as `apply_training_args` read them."""
    result = SFTArgs(unknown_options=unknown_options(options.script_args), defaults=sft_defaults())
    sources = [("the script arguments after -- give", options.script_fields)]
    if (saved := options.saved_args) is not None:
        result.is_sft = "max_length" in saved and "packing" in saved  # an SFTConfig, not a TrainingArguments
        sources.append((f"--args {options.args} gives", saved))
    for where, fields in sources:
        for name, value in fields.items():
            if name in EVAL_ONLY:
                result.eval_only.setdefault(name, value)
            if name not in FIELDS or name in result.given:
                continue
            if name == "eos_token" and value == "<EOS_TOKEN>" and where.startswith("--args"):
                result.hidden_eos_token = where.removesuffix(" gives")
                continue
            result.given[name] = _convert(name, value)
            if result.given[name] is _BAD:
                raise ValueError(f"{where} {name}={value!r}, which is not {FIELDS[name]}.")
            if not where.startswith("--args") and name != "seed":
                result.is_sft = True  # seed is TrainingArguments' too: no sign of an SFT run
    return result


def unknown_options(argv: list[str]) -> list[str]:
    """The options among a script's arguments that are no field of SFTConfig (TrainingArguments without TRL)."""
    try:
        from trl import SFTConfig as config
    except ImportError:
        from transformers import TrainingArguments as config
    fields = dataclasses.fields(config)
    names = {field.name for field in fields}
    booleans = {f.name for f in fields if f.type in (bool, "bool") or str(f.type) in ("bool", "bool | None")}
    unknown = []
    for item in argv:
        with contextlib.suppress(ValueError):
            float(item)
            continue  # a value, such as -1
        if not item.startswith("-"):
            continue
        name = item.lstrip("-").split("=", 1)[0].replace("-", "_")
        # HfArgumentParser's --no_X for a bool defaulting True
        bare = name[3:] if name.startswith("no_") else None
        option = item.split("=", 1)[0]
        if name not in names and bare not in booleans and option not in unknown:
            unknown.append(option)
    return unknown


_BAD = object()


def _convert(field: str, value):
    """`value` of `field` as SFTTrainer takes it (a script's text converted as HfArgumentParser would), else _BAD."""
    text = value.strip() if isinstance(value, str) else None
    if text is not None and text.lower() in ("none", "null") and field not in ("dataset_text_field",):
        value = None
    if value is None:
        return None if FIELDS[field].endswith(" or None") else _BAD
    if field in BOOLEAN_FIELDS:
        return value if isinstance(value, bool) else BOOLEANS.get(text.lower(), _BAD) if text else _BAD
    parse = {"max_length": int, "seed": int, "dataset_num_proc": int, "dataset_kwargs": json.loads}.get(field)
    if parse is not None and text is not None:
        with contextlib.suppress(ValueError):
            value = parse(value)
    if parse is int:
        valid = isinstance(value, int) and not isinstance(value, bool) and (field == "seed" or value >= 1)
    elif field in CHOICES:
        valid = value in CHOICES[field]
    else:
        valid = isinstance(value, dict if field == "dataset_kwargs" else str)
    return value if valid else _BAD
