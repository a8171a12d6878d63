"""`adaptive-batch`: one module a command, each with `HELP`, `add_arguments(parser)`, `run(options) -> dict` (what
`--json` prints) and `show(result)`; a failure is one line on stderr and exit code 1. See docs/how-it-works.md."""

from __future__ import annotations

import argparse
import json
import sys

from .. import __version__
from . import plan, plot, probe
from .arguments import CommandParser

COMMANDS = {"probe": probe, "plan": plan, "plot": plot}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="adaptive-batch", description="Exact, adaptive batch sizes for the HF Trainer."
    )
    parser.add_argument("--version", action="version", version=f"adaptive-batch {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    for name, command in COMMANDS.items():
        subparser = commands.add_parser(name, help=command.HELP)
        command.add_arguments(subparser)
        subparser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    options = parser.parse_args(argv)
    command = COMMANDS[options.command]
    try:
        result = command.run(options)
    except (ValueError, OSError, ImportError) as error:
        print(f"adaptive-batch: error: {error}", file=sys.stderr)
        return 1
    if options.json:
        result.pop("table", None)  # the same numbers laid out for a human
        print(json.dumps(result, indent=1, default=str))
    else:
        command.show(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
