"""The order of a benchmark's arms and each arm's own warm-up, shared by the scripts that time several arms in one
process.

Two habits keep a comparison of arms from measuring their position in the call instead of the arms:

- rounds: the arms run once per round, every other round in reverse order (A B C, then C B A), so that every arm's
  mean position is the same; the scripts default to two rounds;
- warm-ups: before its first timed run, each arm trains a few unrecorded steps of its own (its shapes, its
  kernels, its allocator state), not only the process's first arm. On the H200 an arm run first after a warm-up
  of another arm ran 1.8x slower than the same arm later in one call (`results/packing_throughput_h200_halving.json`
  against `results/packing_throughput_h200.json`), its first step excluded in both.

Example:

    warm_ups = WarmUps(options.warmup_steps)
    for round_, name in interleaved(arms, options.rounds):
        warm_ups.before(name, run_arm, name, ..., steps=options.warmup_steps)
        result = run_arm(name, ..., steps=options.steps)
    report["warmup"] = warm_ups.record()
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

ROUNDS = 2
WARMUP_STEPS = 1


def interleaved(arms: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, arm) in the order to run them: A B C, C B A, ... so that every arm's mean position is the same."""
    return [(r, name) for r in range(rounds) for name in (arms if r % 2 == 0 else arms[::-1])]


def add_arguments(parser: argparse.ArgumentParser, unit: str = "steps") -> None:
    """`--rounds` (default 2) and `--warmup-steps` (default 1; `--warmup-evaluations` where `unit` is
    "evaluations")."""
    parser.add_argument(
        "--rounds",
        type=int,
        default=ROUNDS,
        help="run the arms this many times, every other round in reverse order",
    )
    parser.add_argument(
        f"--warmup-{unit}",
        type=int,
        default=WARMUP_STEPS,
        help=f"before each arm's first timed run, {unit} of the same arm, unrecorded (0: none)",
    )


class WarmUps:
    """Runs each arm's warm-up once, before its first timed run, and keeps the seconds each took."""

    def __init__(self, count: int, unit: str = "steps"):
        self.count, self.unit = count, unit
        self.seconds: dict[str, float] = {}

    def before(self, name: str, run: Callable[..., Any], *args, **kwargs) -> None:
        """`run(*args, **kwargs)` (the arm `name` for `count` steps, its result dropped) unless `name` was warmed up
        already or `count` is 0."""
        if not self.count or name in self.seconds:
            return
        started = time.perf_counter()
        run(*args, **kwargs)
        self.seconds[name] = time.perf_counter() - started

    def record(self) -> dict:
        """For the JSON: how many steps (or evaluations) each arm's warm-up ran, and its seconds per arm."""
        return {self.unit: self.count, "per_arm": True, "seconds": self.seconds}
