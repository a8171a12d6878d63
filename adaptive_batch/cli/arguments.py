"""What the commands' options share: the `--help` formatter, the positive-integer type, and the help of an option
that is an `AdaptiveBatch` setting, read from `core.config` so that `--help` and `AdaptiveBatch`'s docstring say
the same thing."""

from __future__ import annotations

import argparse

from ..core.config import help_text


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows every option's default after its help text, except where there is none to show (`None`, a
    switch's `False`, an empty string): those options say in their help what happens without them."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == "":
            return action.help
        return super()._get_help_string(action)


def setting_help(name: str, command_line: str = "") -> str:
    """The help of the `AdaptiveBatch` setting `name`, then `command_line`: how the option spells it, where the
    command line cannot take every form the setting can."""
    text = f"{help_text(name)} {command_line}".strip()
    return text.replace("%", "%%")  # argparse formats help with %, so a literal one must be doubled


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value
