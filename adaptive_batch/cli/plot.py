"""`adaptive-batch plot`: draw a run's batch sizes, noise scale, LR and loss against samples seen into a PNG."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "draw a run's batch sizes, noise scale, LR and loss against samples seen (PNG)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dir",
        type=Path,
        help="a Trainer output_dir (its trainer_state.json, else its newest checkpoint's) or a trainer_state.json",
    )
    parser.add_argument("--out", type=Path, help="the PNG to write (default: RUN_DIR/adaptive_batch.png)")


def run(options: argparse.Namespace) -> dict:
    """Draw the run into a PNG and return where it went, with what was read."""
    from . import figure  # (matplotlib only where a picture is drawn)

    series = figure.read_run(options.run_dir)
    png = figure.write_png(series, options.out or figure.default_png(options.run_dir))
    return {
        "png": str(png),
        "trainer_state": series.source,
        "logged_steps": len(series.step),
        "last_step": series.step[-1],
        "samples_seen": series.samples_seen[-1],
        "evaluations": len(series.eval_loss),
        "noise_scale_measured": series.noise_measured,
    }


def show(result: dict) -> None:
    print(
        f"{result['png']}: {result['logged_steps']} logged steps to step {result['last_step']}, "
        f"{result['samples_seen']:,} samples (from {result['trainer_state']})"
    )
