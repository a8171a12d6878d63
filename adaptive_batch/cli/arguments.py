"""What the commands' options share: a parser that shows defaults in `--help`, numeric types that refuse a bad value
naming the option, and the help of an `AdaptiveBatch` setting (its meaning from `core.config`)."""

from __future__ import annotations

import argparse
import math

from ..core.config import meaning


class CommandParser(argparse.ArgumentParser):
    """A command's parser: `--help` shows a default after its help text where there is one (not `None`, `False`,
    ''; `ArgumentDefaultsHelpFormatter`'s only public part is its name), and each [`_Typed`] learns its option."""

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
    """The help of an option for the `AdaptiveBatch` setting `name`: its meaning, then `command_line`, its values."""
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
