"""The plain arms' real tokens per step in ragged_throughput results written before the count was fixed, re-derived.

Until 2026-12-07 ragged_throughput.py read its collator's running count at each step's end. The plain Trainer's
dataloader reads one batch ahead, so that count held the next step's first micro-batch too: a plain arm's step i was
credited with its own tokens plus the next step's first micro-batch less its own first one. Over the steps after the
first this moves tokens between steps at the window's two ends (a whole step for 64 x 1, an eighth of one for 8 x 8),
and the plain arms' figures were off by up to a few percent, in either direction. AdaptiveBatch arms were counted
right: they collate one batch a step, in the last of their accumulation slots, so the batch read ahead is an empty
slot.

Every arm of a call trains on the same rows in the same steps (one sampler seed, 64 rows a step; the `fixed` arm on
rows of one length, FIXED_LENGTH tokens each), so a step's true tokens are the AdaptiveBatch arm's for that step. This
script checks that each plain run's recorded counts are exactly those tokens plus one micro-batch read ahead (the
whole next step at accumulation 1; more than nothing and less than the next step otherwise; nothing once the data
ran out), replaces its per-step tokens with the true ones, and pools every arm again on ragged_throughput's own
bases (`after_first_part`, `steady_part`). A run that fails the check is left as recorded and named in
`not_realigned`.

Usage: python benchmarks/realign_plain_tokens.py OUT.json RESULTS.json...   (one report of every input, in a list)
"""

from __future__ import annotations

import copy
import json
import os
import sys
from itertools import accumulate

sys.path.insert(0, os.path.dirname(__file__))

from ragged_throughput import ARMS, FIXED_LENGTH, after_first_part, pool, steady_part  # noqa: E402


def true_tokens(report: dict) -> list[int]:
    """The tokens of every step, from the AdaptiveBatch arms (all of them must agree where their steps overlap)."""
    adaptive = [run["real_tokens_per_step"] for run in report["runs"] if ARMS[run["arm"]][3] is not None]
    longest = max(adaptive, key=len)
    for tokens in adaptive:
        assert tokens == longest[: len(tokens)], "AdaptiveBatch arms trained on different steps"
    return longest


def realigned(run: dict, steps: list[int]) -> list[int] | None:
    """The run's true tokens per step, or None where its recorded counts are not `steps` plus one batch read ahead."""
    per_device, accumulation, *_ = ARMS[run["arm"]]
    recorded = run["real_tokens_per_step"]
    if run["arm"] == "fixed":
        steps = [per_device * accumulation * FIXED_LENGTH] * (len(recorded) + 1)
    if len(steps) < len(recorded):
        return None
    ahead = [count - true for count, true in zip(accumulate(recorded), accumulate(steps))]
    for i, extra in enumerate(ahead):
        following = steps[i + 1] if i + 1 < len(steps) else None
        if accumulation == 1 and extra not in (following, 0):
            return None
        if accumulation > 1 and not (extra == 0 or (following is not None and 0 < extra < following)):
            return None
    return steps[: len(recorded)]


def realign(report: dict) -> dict:
    """The report with its plain runs' tokens realigned and a `realigned` summary: per arm, the runs pooled after
    their first step and steady (as in ragged_throughput's summary), and their ratios to the plain arms."""
    report = copy.deepcopy(report)
    steps, skipped = true_tokens(report), []
    for run in report["runs"]:
        if ARMS[run["arm"]][3] is not None:
            continue
        tokens = realigned(run, steps)
        if tokens is None:
            skipped.append(f"{run['arm']} round {run.get('round')}")
            continue
        run["recorded_real_tokens_per_step"], run["real_tokens_per_step"] = (
            run["real_tokens_per_step"],
            tokens,
        )
    by_arm: dict[str, list] = {}
    for run in report["runs"]:
        by_arm.setdefault(run["arm"], []).append(run)
    after = {name: pool([after_first_part(run) for run in runs]) for name, runs in by_arm.items()}
    steady = {name: pool([steady_part(run) for run in runs]) for name, runs in by_arm.items()}
    flat = max((after[name] for name in after if name.startswith("flat")), default=None)
    flat_steady = max((steady[name] for name in steady if name.startswith("flat")), default=None)
    summary = {}
    for name in by_arm:
        summary[name] = {
            "real_tokens_per_second": after[name],
            "over_random": after[name] / after["random"] if "random" in after else None,
            "over_best_plain_flat": after[name] / flat if flat else None,
            "real_tokens_per_second_steady": steady[name],
            "steady_over_best_plain_flat": steady[name] / flat_steady if flat_steady else None,
            "steady_over_fixed": steady[name] / steady["fixed"] if "fixed" in steady else None,
        }
        if all("train_seconds" in run for run in by_arm[name]):
            whole = sum(sum(run["real_tokens_per_step"]) for run in by_arm[name])
            summary[name]["whole_run_real_tokens_per_second"] = whole / sum(
                run["train_seconds"] for run in by_arm[name]
            )
    report["realigned"] = summary
    report["not_realigned"] = skipped
    return report


def main(out: str, sources: list[str]) -> None:
    reports = []
    for source in sources:
        with open(source) as f:
            report = realign(json.load(f))
        kept = ("arm", "round", "step_seconds", "real_tokens_per_step", "recorded_real_tokens_per_step")
        reports.append(
            {
                "source": os.path.basename(source),
                "command": report["command"],
                "device": report["device"],
                "mix": report["lengths"].get("mix"),
                "not_realigned": report["not_realigned"],
                "realigned": report["realigned"],
                "runs": [{key: run[key] for key in kept if key in run} for run in report["runs"]],
            }
        )
        report = reports[-1]
        print(f"{report['source']}: not realigned {report['not_realigned'] or 'none'}")
        for name, arm in report["realigned"].items():
            line = ", ".join(f"{key} {value:,.3f}" for key, value in arm.items() if value is not None)
            print(f"  {name:>10}: {line}")
    with open(out, "w") as f:
        json.dump(reports, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
