"""What the commands' options share: the parser that shows defaults in `--help`, the argparse types of numeric
options (a bad value refused naming the option, the rule and an example), and the help of an option that is an
`AdaptiveBatch` setting (its meaning from `core.config`, so that `--help` and the docstring agree)."""

from __future__ import annotations

import argparse
import math

from ..core.config import meaning


class CommandParser(argparse.ArgumentParser):
    """A command's parser: `--help` shows an option's default after its help text, except where there is none to
    show (`None`, a switch's `False`, an empty string): those options say in their help what happens without them.

    Added here rather than by `ArgumentDefaultsHelpFormatter`, whose only public part is its name."""

    def add_argument(self, *names, **kwargs):
        default, help_text = kwargs.get("default"), kwargs.get("help")
        # (SUPPRESS: the default of --help itself)
        hidden = default is None or default is False or default in ("", argparse.SUPPRESS)
        if help_text not in (None, argparse.SUPPRESS) and not hidden:
            kwargs["help"] = help_text + " (default: %(default)s)"
        if isinstance(kwargs.get("type"), _Typed) and not kwargs["type"].flag:
            kwargs["type"].flag = names[0]  # the option a bad value is refused for
        return super().add_argument(*names, **kwargs)


def setting_help(name: str, command_line: str) -> str:
    """The help of an option that takes the `AdaptiveBatch` setting `name`: the setting's meaning, then
    `command_line`, the values in the option's own syntax (a callable cannot be typed on a command line)."""
    text = f"{meaning(name)}: {command_line}"
    return text.replace("%", "%%")  # argparse formats help with %, so a literal one must be doubled


class _Typed:
    """The argparse type of option `flag` (a [`CommandParser`] sets it to the option's name): `convert(text)` where
    it is accepted, else argparse prints `argument FLAG: 'abc' is not RULE, e.g. FLAG EXAMPLE`."""

    def __init__(self, example, convert, rule: str, accept=lambda value: True, flag: str = ""):
        self.example, self.convert, self.rule, self.accept, self.flag = example, convert, rule, accept, flag

    def __call__(self, text: str):
        try:
            value = self.convert(text)
        except ValueError:
            value = None
        if value is None or not self.accept(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {self.rule}, e.g. {self.flag} {self.example}")
        return value


def positive_int(example, flag: str = ""):
    return _Typed(example, int, "a positive int", lambda value: value >= 1, flag)


def positive_number(example):
    return _Typed(example, float, "a positive number", lambda value: math.isfinite(value) and value > 0)


def integer(example):
    return _Typed(example, int, "an int")
