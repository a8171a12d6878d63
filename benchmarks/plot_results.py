"""Pictures of the committed benchmark results: every value drawn is read from the JSON in `benchmarks/results/`,
nothing is typed in here.

Usage:

    python benchmarks/plot_results.py --results benchmarks/results --out benchmarks/results/plots

Writes, each only when its JSON is there (a missing one is named on stdout and skipped):

| PNG | what | JSON |
| --- | --- | --- |
| `qlora_throughput.png` | tokens/s and peak memory against the micro-batch | `qlora_throughput_h200.json` |
| `probe_boundary.png` | peak reserved memory and tokens/s against the micro-batch, 1,024 and 4,096 tokens | `probe_boundary_{1024,4096}_h200.json` |
| `ragged_throughput.png` | the row-length histogram, real tokens/s per mode in both orders | `ragged_throughput_h200{,_reversed}.json` |
| `noise_schedule_run.png` | effective batch, noise scale, LR and loss against samples, one `NoiseScaleSchedule` run | `time_to_loss_rerun_seeds_h200.json` |
| `time_to_target.png` | seconds to the target loss per arm and seed, in both calls | `time_to_loss_summary.json`, `time_to_loss_rerun_compare.json` |

Drawn on matplotlib's Agg canvas (no window, no pyplot), at 100 dpi, without the matplotlib version in the PNG's
metadata, so the same JSON gives the same bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adaptive_batch.cli.figure import draw, read_series  # noqa: E402

DPI = 100
GIB = 2**30
QLORA = "qlora_throughput_h200.json"
PROBES = ("probe_boundary_1024_h200.json", "probe_boundary_4096_h200.json")
RAGGED = ("ragged_throughput_h200.json", "ragged_throughput_h200_reversed.json")
NOISE_RUN = ("time_to_loss_rerun_seeds_h200.json", "noise", 0)  # file, arm, seed
TIME_TO_TARGET = ("time_to_loss_summary.json", "time_to_loss_rerun_compare.json")


# Values read from the JSON (also what the tests check against the files).


def plain_tokens_per_second(report: dict) -> dict[int, float]:
    """Micro-batch (= per-device size, accumulation making up the 64) -> tokens/s after the first step, for the
    plain Trainer's runs of `qlora_throughput.py`."""
    return {
        run["per_device_train_batch_size"]: run["tokens_per_second_after_first_step"]
        for run in report["runs"]
        if run["kind"] == "plain"
    }


def best_plain(report: dict) -> tuple[str, float]:
    """The fastest plain pair, as `"64x1"`, and its tokens/s."""
    run = max(
        (run for run in report["runs"] if run["kind"] == "plain"),
        key=lambda run: run["tokens_per_second_after_first_step"],
    )
    pair = f"{run['per_device_train_batch_size']}x{run['gradient_accumulation_steps']}"
    return pair, run["tokens_per_second_after_first_step"]


def ragged_speeds(forward: dict, reverse: dict | None) -> dict[str, tuple[float, float | None]]:
    """Arm -> real tokens/s over the steps after the first (the README's measure for every arm) in the forward
    and the reverse run, in the forward run's order."""
    reversed_speeds = {run["arm"]: run["real_tokens_per_second"] for run in (reverse or {}).get("runs", [])}
    return {
        run["arm"]: (run["real_tokens_per_second"], reversed_speeds.get(run["arm"]))
        for run in forward["runs"]
    }


def ragged_ratios(speeds: dict[str, tuple[float, float | None]], arm: str, base: str) -> list[float]:
    """`arm`'s real tokens/s over `base`'s: in each run, then on the means of the two runs."""
    runs = [a / b for a, b in zip(speeds[arm], speeds[base]) if a is not None and b is not None]
    return runs + [statistics.mean(_present(speeds[arm])) / statistics.mean(_present(speeds[base]))]


def noise_run(report: dict, arm: str, seed: int) -> dict:
    """The first run of `arm` and `seed` in a `time_to_loss.py` result."""
    return next(run for run in report["runs"] if run["arm"] == arm and run["seed"] == seed)


def seconds_to_target(table: list[dict]) -> dict[str, list[float | None]]:
    """Arm -> seconds to the target per seed, in seed order (`None`: never reached), from a summary's table."""
    arms: dict[str, list[tuple[int, float | None]]] = {}
    for row in table:
        arms.setdefault(row["arm"], []).append((row["seed"], row["seconds_to_target"]))
    order = sorted(
        arms,
        key=lambda arm: (not arm.startswith("fixed"), int(arm[5:] or 0) if arm.startswith("fixed") else 0),
    )
    return {arm: [seconds for _, seconds in sorted(arms[arm])] for arm in order}


def median_to_target(times: list[float | None]) -> float | None:
    """The median with a run that never reached the target counted as infinitely slow, as `time_to_loss.py`
    counts it; `None` when that median is such a run."""
    value = statistics.median(float("inf") if t is None else t for t in times)
    return value if value != float("inf") else None


def best_fixed_median(medians: dict[str, float | None]) -> float:
    """The smallest finite median of the `fixed*` arms."""
    return min(m for arm, m in medians.items() if arm.startswith("fixed") and m is not None)


# One figure per plot.


def qlora_figure(report: dict) -> Figure:
    """Tokens/s and peak memory against the micro-batch, QLoRA 7B at a constant effective batch of 64."""
    figure, (speed_axes, memory_axes) = _figure((11, 4.2), 1, 2)
    plain = [run for run in report["runs"] if run["kind"] == "plain"]
    sizes = [run["per_device_train_batch_size"] for run in plain]
    speed_axes.plot(
        sizes,
        [run["tokens_per_second_after_first_step"] for run in plain],
        marker="o",
        label="plain Trainer (size x accumulation = 64)",
    )
    for run in report["runs"]:
        if run["kind"] == "fixed":
            speed_axes.plot(
                run["per_device_train_batch_size"],
                run["tokens_per_second_after_first_step"],
                marker="x",
                markersize=10,
                color="C1",
                linestyle="",
                label="AdaptiveBatch(micro_batch_size=N)" if run is _first(report, "fixed") else None,
            )
        if run["kind"] == "auto":
            trials = sorted((int(size), speed) for size, speed in run["controller"]["throughput"].items())
            speed_axes.plot(
                [size for size, _ in trials],
                [speed for _, speed in trials],
                marker=".",
                linestyle="--",
                color="C2",
                label="AdaptiveBatch() from 1 x 64: its timed trials",
            )
            speed_axes.plot(
                run["controller"]["size"],
                run["tokens_per_second_steady"],
                marker="*",
                markersize=14,
                color="C2",
                linestyle="",
                label=f"... settled at {run['controller']['size']}: {run['tokens_per_second_steady']:,.0f} tokens/s",
            )
    pair, speed = best_plain(report)
    speed_axes.axhline(
        speed, color="grey", linewidth=0.8, linestyle=":", label=f"best pair {pair}: {speed:,.0f}"
    )
    speed_axes.set(xscale="log", xlabel="micro-batch (samples)", ylabel="tokens/s (steps after the first)")
    speed_axes.set_xticks(sizes, [str(size) for size in sizes])
    speed_axes.legend(fontsize=8, loc="lower right")

    memory_axes.plot(sizes, [run["peak_allocated_gib"] for run in plain], marker="o", label="peak allocated")
    memory_axes.plot(sizes, [run["peak_reserved_gib"] for run in plain], marker="s", label="peak reserved")
    memory_axes.set(xscale="log", xlabel="micro-batch (samples)", ylabel="GiB (plain Trainer)")
    memory_axes.set_xticks(sizes, [str(size) for size in sizes])
    memory_axes.legend(fontsize=8)
    figure.suptitle(f"{report['model']}, {report['seq_len']:,} tokens, {report['device']}", fontsize="medium")
    return figure


def probe_figure(reports: list[dict]) -> Figure:
    """Per sequence length: peak memory of every training-step trial inside the exhaustive window, with the limit
    and the boundaries (reserved memory is not monotone there), and the tokens/s of every trial."""
    figure, axes = _figure((5.5 * len(reports), 7.5), 2, len(reports), squeeze=False)
    for column, report in enumerate(reports):
        memory_axes, speed_axes = axes[0][column], axes[1][column]
        probe, exhaustive = report["probe"], report["exhaustive"]
        low, high = exhaustive["window"]
        steps = [
            t for t in probe["trials"] if not t.get("forward_only")
        ]  # a forward pass's peak is not a step's
        window = [t for t in exhaustive["trials"] + steps if low <= t["size"] <= high]
        for fits, marker, label in ((True, "o", "fits"), (False, "X", "over the limit")):
            chosen = [t for t in window if t["fits"] == fits]
            memory_axes.plot(
                [t["size"] for t in chosen],
                [t["peak_bytes"] / GIB for t in chosen],
                marker=marker,
                linestyle="",
                color="C0" if fits else "C3",
                label=f"peak reserved, {label}",
            )
        memory_axes.plot(
            [t["size"] for t in window],
            [t["peak_allocated_bytes"] / GIB for t in window],
            marker=".",
            linestyle="",
            color="C2",
            label="peak allocated",
        )
        limit = probe["limit_bytes"] / GIB
        memory_axes.axhline(limit, color="grey", linestyle="--", linewidth=1, label=f"limit {limit:.1f} GiB")

        for trials, name, marker in ((steps, "probe", "o"), (exhaustive["trials"], "exhaustive", ".")):
            timed = [t for t in trials if t["tokens_per_second"] and t["fits"]]
            speed_axes.plot(
                [t["size"] for t in timed],
                [t["tokens_per_second"] for t in timed],
                marker=marker,
                linestyle="" if name == "probe" else "-",
                label=f"{name}: training step",
            )
        forward = [t for t in probe["trials"] if t.get("forward_only")]
        if forward:
            speed_axes.plot(
                [t["size"] for t in forward],
                [t["tokens_per_second"] for t in forward],
                marker="^",
                linestyle="",
                label="probe: forward pass, scaled to a step",
            )
        marks = [
            ("probe boundary", probe["boundary"], "C3"),
            ("true boundary", exhaustive["true_boundary"], "k"),
        ]
        for label, size, color in marks:
            memory_axes.axvline(size, color=color, linestyle=":", linewidth=1, label=f"{label}: {size}")
        for label, size, color in marks + [("recommended", probe["recommended"], "C4")]:
            speed_axes.axvline(size, color=color, linestyle=":", linewidth=1, label=f"{label}: {size}")
        memory_axes.set(
            xlabel="micro-batch (samples)",
            ylabel="GiB",
            title=f"{report['seq_len']:,} tokens per sample: the sizes {low} to {high}",
        )
        speed_axes.set(xlabel="micro-batch (samples)", ylabel="tokens/s", title="every trial")
        memory_axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        memory_axes.legend(fontsize=7, loc="center right")
        speed_axes.legend(fontsize=7, loc="lower right")
    figure.suptitle(
        f"adaptive-batch probe and the exhaustive check, {reports[0]['device']}", fontsize="medium"
    )
    return figure


def ragged_figure(forward: dict, reverse: dict | None) -> Figure:
    """The rows' length histogram (as the JSON bins it) and each mode's real tokens/s in both orders."""
    figure, (histogram_axes, speed_axes) = _figure((12, 5), 1, 2, width_ratios=(1, 2))
    lengths = forward["lengths"]
    bins = list(lengths["histogram"])
    histogram_axes.bar(range(len(bins)), list(lengths["histogram"].values()))
    histogram_axes.set_xticks(range(len(bins)), bins, rotation=30)
    histogram_axes.set(
        xlabel="row length (tokens; bins of unequal width)",
        ylabel="rows",
        title=f"{lengths['rows']:,} rows, mean {lengths['mean']:.0f}:\n"
        + lengths["distribution"].replace(", ", "\n", 1),
    )
    histogram_axes.title.set_fontsize("small")

    speeds = ragged_speeds(forward, reverse)
    labels = {run["arm"]: _ragged_label(run) for run in forward["runs"]}
    rows = list(range(len(speeds)))[::-1]  # the forward order from the top
    speed_axes.barh(
        [row + 0.2 for row in rows], [f for f, _ in speeds.values()], height=0.4, label="forward order"
    )
    if reverse is not None:
        speed_axes.barh(
            [row - 0.2 for row in rows],
            [r or 0 for _, r in speeds.values()],
            height=0.4,
            label="reverse order",
        )
        base = statistics.mean(_present(speeds["random"]))
        speed_axes.axvline(
            base, color="grey", linestyle="--", linewidth=1, label=f"random, mean: {base:,.0f}"
        )
        for row, (arm, pair) in zip(rows, speeds.items()):
            mean = statistics.mean(_present(pair))
            text = f"mean {mean:,.0f}, x{ragged_ratios(speeds, arm, 'random')[-1]:.2f} random"
            speed_axes.text(max(_present(pair)) + 80, row, text, va="center", fontsize=7)
    speed_axes.set_yticks(rows, [labels[arm] for arm in speeds], fontsize=7)
    fastest = max(value for pair in speeds.values() for value in _present(pair))
    speed_axes.set(xlabel="real (non-padding) tokens/s, steps after the first", xlim=(0, 1.35 * fastest))
    speed_axes.legend(fontsize=8, loc="upper right")
    figure.suptitle(f"Ragged lengths: {forward['model']}, {forward['device']}", fontsize="medium")
    return figure


def noise_run_figure(report: dict, arm: str, seed: int, source: str) -> Figure:
    """`adaptive_batch.cli.figure`'s picture of one run from its logged steps (every 20th) and evaluations, with the
    effective batch of every step drawn again from the schedule's changes and the target loss marked."""
    run = noise_run(report, arm, seed)
    evaluations = [{"step": point["step"], "eval_loss": point["eval_loss"]} for point in run["points"]]
    series = read_series(run["logs"] + evaluations, source=f"{source}: {arm}, lr {run['lr']:g}, seed {seed}")
    series.eval_samples_seen = [
        point["samples"] for point in run["points"]
    ]  # exact, not interpolated by step
    figure = draw(series)
    batch_axes, loss_axes = figure.axes[0], figure.axes[3]
    # The logs come every 20th step; the changes say exactly where each size began.
    edges = [0] + [change["samples_seen"] for change in run["changes"]] + [run["points"][-1]["samples"]]
    sizes = [series.effective_batch_size[0]] + [change["size"] for change in run["changes"]]
    batch_axes.step(
        edges, sizes + sizes[-1:], where="post", color="k", linewidth=1, label="effective batch (changes)"
    )
    batch_axes.set_ylim(0, 1.3 * max(sizes))
    batch_axes.legend(loc="upper left")
    target = report.get("summary", {}).get("target_eval_loss")
    if target is not None:
        loss_axes.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.3f}")
        loss_axes.legend(loc="upper right")
    return figure


def time_to_target_figure(calls: list[tuple[str, list[dict], float]]) -> Figure:
    """Seconds to the target per arm: each seed a dot, the median a bar, labelled with its ratio to the best fixed
    arm's median of the same call; one panel per call (times from different calls are not compared)."""
    figure, axes = _figure(
        (11, 4.5),
        1,
        len(calls),
        squeeze=False,
        width_ratios=[len(seconds_to_target(t)) + 2 for _, t, _ in calls],
    )
    for panel, (title, table, target) in zip(axes[0], calls):
        times = seconds_to_target(table)
        medians = {arm: median_to_target(seeds) for arm, seeds in times.items()}
        best_fixed = best_fixed_median(medians)
        labels = []
        for row, (arm, seeds) in enumerate(times.items()):
            reached = [t for t in seeds if t is not None]
            median = medians[arm]
            if median is not None:
                panel.bar(row, median, color="C0", alpha=0.35, label="median" if not labels else None)
                labels.append(f"{arm}\n{median:.1f} s, x{median / best_fixed:.2f}")
            else:
                labels.append(f"{arm}\nnot reached")
            panel.plot([row] * len(reached), reached, "o", color="C0", label="a seed" if row == 0 else None)
            labels[-1] += f"\n{len(reached)} of {len(seeds)} reached"
        panel.set_xticks(range(len(times)), labels, fontsize=7)
        longest = max(t for seeds in times.values() for t in seeds if t is not None)
        panel.set(ylabel="seconds to target (evaluation excluded)", ylim=(0, 1.25 * longest))
        panel.set_title(
            f"{title}\ntarget eval loss {target:.3f}; x: over the best fixed arm's median", fontsize=9
        )
        panel.legend(fontsize=8, loc="upper right")
    return figure


# Writing.


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="benchmarks/results", help="folder of the committed JSON")
    parser.add_argument("--out", default="benchmarks/results/plots", help="folder for the PNGs")
    options = parser.parse_args(argv)
    results, out = Path(options.results), Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    def write(name: str, needs: tuple[str, ...], make) -> None:
        missing = [file for file in needs if not (results / file).is_file()]
        if missing:
            print(f"skipped {name}: no {', '.join(missing)} in {results}")
            return
        path = out / name
        make(*(_load(results / file) for file in needs)).savefig(path, dpi=DPI, metadata={"Software": None})
        print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KB)")
        written.append(path)

    write("qlora_throughput.png", (QLORA,), qlora_figure)
    write("probe_boundary.png", PROBES, lambda *reports: probe_figure(list(reports)))
    write("ragged_throughput.png", RAGGED, ragged_figure)
    file, arm, seed = NOISE_RUN
    write("noise_schedule_run.png", (file,), lambda report: noise_run_figure(report, arm, seed, file))
    write(
        "time_to_target.png",
        TIME_TO_TARGET,
        lambda first, rerun: time_to_target_figure(
            [
                (TIME_TO_TARGET[0], first["summary"]["table"], first["summary"]["target_eval_loss"]),
                (TIME_TO_TARGET[1], rerun["table"], rerun["target_eval_loss"]),
            ]
        ),
    )
    return written


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _figure(inches, rows, columns, **options):
    figure = Figure(figsize=inches, dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    grid = {key: options.pop(key) for key in ("width_ratios",) if key in options}
    return figure, figure.subplots(rows, columns, gridspec_kw=grid or None, **options)


def _first(report: dict, kind: str) -> dict:
    return next(run for run in report["runs"] if run["kind"] == kind)


def _ragged_label(run: dict) -> str:
    """`auto: 8x8, padding collator` over `AdaptiveBatch(...)`, from the run's own fields."""
    pair = f"{run['per_device_train_batch_size']}x{run['gradient_accumulation_steps']}"
    settings = run["adaptive_batch"]
    if settings is None:
        how = (
            ", ".join(f"{key}={value}" for key, value in run["training_arguments"].items()) or "plain Trainer"
        )
    else:
        how = "AdaptiveBatch(" + ", ".join(f"{key}={value}" for key, value in settings.items()) + ")"
    return f"{run['arm']}: {pair}, {run['collator']} collator\n{how}"


def _present(values) -> list[float]:
    return [value for value in values if value is not None]


if __name__ == "__main__":
    main()
