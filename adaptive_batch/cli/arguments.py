"""What the commands' options share: the `--help` formatter, the types of numeric options (a bad value is refused
naming the option, the rule and an example), and the help of an option that is an `AdaptiveBatch` setting: the
setting's meaning read from `core.config`, so that `--help` and `AdaptiveBatch`'s docstring say the same thing, then
the values in the option's own syntax."""

from __future__ import annotations

import argparse
import math

from ..core.config import meaning


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows every option's default after its help text, except where there is none to show (`None`, a
    switch's `False`, an empty string): those options say in their help what happens without them."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == "":
            return action.help
        return super()._get_help_string(action)


def setting_help(name: str, command_line: str) -> str:
    """The help of an option that takes the `AdaptiveBatch` setting `name`: what the setting is (`core.config`'s
    words), then `command_line`, the values the option takes in its own syntax (never the Python forms: a
    `NoiseScaleSchedule` or a callable cannot be typed on a command line)."""
    text = f"{meaning(name)}: {command_line}"
    return text.replace("%", "%%")  # argparse formats help with %, so a literal one must be doubled


def positive_int(flag: str, example: int = 8):
    """The argparse type of an option `flag` that takes a positive integer: a bad value is refused with the rule and
    an example (argparse prints `argument FLAG: 'abc' is not a positive int, e.g. FLAG 8`)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < 1:
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive int, e.g. {flag} {example}")
        return value

    return parse


def number(flag: str, example: str, positive: bool = False):
    """The argparse type of an option `flag` that takes a number (a positive one where `positive`)."""
    rule = "a positive number" if positive else "a number"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or (positive and value <= 0):
            raise argparse.ArgumentTypeError(f"{text!r} is not {rule}, e.g. {flag} {example}")
        return value

    return parse


def integer(flag: str, example: str):
    """The argparse type of an option `flag` that takes an integer (any sign)."""

    def parse(text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int, e.g. {flag} {example}") from None

    return parse
