"""`adaptive-batch`: the command line.

    adaptive-batch probe ./llama --seq-len 1024 --load-in-4bit --lora-r 16 --lora-target q_proj,v_proj \\
        --optim paged_adamw_8bit --effective-batch 64
    adaptive-batch plan --dataset-size 52000 --per-device 4 --accumulation 8 --gpus 2 --epochs 3 \\
        --schedule 32,64,128 --boundaries 0.1,0.3 --lr-scaling sqrt
    adaptive-batch plot ./out

`probe` finds the largest micro-batch that fits and the fastest one, and caches the result for
`AdaptiveBatch(micro_batch_size="auto")`. `plan` prints what a run will do before it starts: optimizer steps,
samples, tokens, epochs and the learning-rate multiplier of every phase, with warnings for the classic traps. `plot`
draws a run's effective batch, micro-batch, noise scale, learning rate and loss against samples seen into a PNG,
from the log history the Trainer saved (needs matplotlib: `pip install "adaptive-batch[plot]"`).
`--json` prints one JSON object on stdout (logs go to stderr); a failure is one line on stderr and exit code 1.

Each command is a module ([`probe`], [`plan`], [`plot`]) with its `HELP`, `add_arguments(parser)`,
`run(options) -> dict` (the result as plain data) and `show(result)` (the result for a human).
"""

from __future__ import annotations

import argparse
import json
import sys

from .. import __version__
from . import plan, plot, probe
from .arguments import HelpFormatter

COMMANDS = {"probe": probe, "plan": plan, "plot": plot}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adaptive-batch", description="Exact, adaptive batch sizes for the HF Trainer."
    )
    parser.add_argument("--version", action="version", version=f"adaptive-batch {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        subparser = commands.add_parser(name, help=command.HELP, formatter_class=HelpFormatter)
        command.add_arguments(subparser)
        subparser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    return parser


def main(argv: list[str] | None = None) -> int:
    options = build_parser().parse_args(argv)
    command = COMMANDS[options.command]
    try:
        result = command.run(options)
    except (ValueError, OSError, ImportError) as error:
        print(f"adaptive-batch: error: {error}", file=sys.stderr)
        return 1
    if options.json:
        # the table is the same numbers laid out for a human
        print(
            json.dumps({key: value for key, value in result.items() if key != "table"}, indent=1, default=str)
        )
    else:
        command.show(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
