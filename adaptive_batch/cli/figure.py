"""A run's batch sizes, noise scale, LR and loss against samples seen, from its `trainer_state.json`, drawn on an Agg
canvas (the caller's pyplot left alone): `plot_run("out")` writes out/adaptive_batch.png. See docs/how-it-works.md."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

STATE_FILE = "trainer_state.json"
PNG_NAME = "adaptive_batch.png"
FIGURE_INCHES = (8.0, 10.0)  # width, height
DPI = 100  # so the PNG is 800 x 1000 pixels
SAMPLES_SEEN = "adaptive_batch/samples_seen"
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")


@dataclass
class RunSeries:
    """A run's logged values, one entry per training log (the log key [`TRAINING_KEYS`] names; `None` where a log
    lacks it), plus the evaluations (`eval_samples_seen` interpolated by step); `source`: where they were read."""

    source: str
    step: list[int] = field(default_factory=list)
    samples_seen: list[int] = field(default_factory=list)
    tokens_seen: list[int | None] = field(default_factory=list)
    effective_batch_size: list[int | None] = field(default_factory=list)
    micro_batch_size: list[int | None] = field(default_factory=list)
    accumulation_steps: list[int | None] = field(default_factory=list)
    lr_scale: list[float | None] = field(default_factory=list)
    learning_rate: list[float | None] = field(default_factory=list)
    loss: list[float | None] = field(default_factory=list)
    noise_scale: list[float | None] = field(default_factory=list)
    grad_norm_sq: list[float | None] = field(default_factory=list)
    grad_variance: list[float | None] = field(default_factory=list)
    eval_step: list[int] = field(default_factory=list)
    eval_samples_seen: list[float] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)

    @property
    def noise_measured(self) -> bool:
        """Whether any step logged a noise scale that a log axis can show (positive and finite)."""
        return any(_plottable(value) for value in self.noise_scale)


# each training series and the log key it reads: the Trainer's own, else AdaptiveBatch's
TRAINING_KEYS = {
    f.name: f.name if f.name in ("step", "learning_rate", "loss") else f"adaptive_batch/{f.name}"
    for f in fields(RunSeries)
    if f.name != "source" and not f.name.startswith("eval_")
}


def find_trainer_state(run_dir: str | Path) -> Path:
    """`run_dir`'s `trainer_state.json`: itself if a file, else the output dir's, else its highest checkpoint's."""
    path = Path(run_dir)
    if path.is_file():
        return path
    if not path.exists():
        raise ValueError(
            f"{path} does not exist; pass a Trainer output_dir (holding checkpoint-* folders) or a {STATE_FILE}."
        )
    if (path / STATE_FILE).is_file():
        return path / STATE_FILE
    checkpoints = [
        (int(match.group(1)), child / STATE_FILE)
        for child in path.iterdir()
        if (match := _CHECKPOINT.fullmatch(child.name)) and (child / STATE_FILE).is_file()
    ]
    if not checkpoints:
        raise ValueError(
            f"no {STATE_FILE} in {path} or its checkpoint-* folders: the Trainer writes one at every checkpoint "
            "(save_strategy) and in trainer.save_state(); pass the output_dir of a run that saved one."
        )
    return max(checkpoints)[1]


def load_log_history(state_file: str | Path) -> list[dict]:
    path = Path(state_file)
    try:
        state = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(
            f"{path} is not JSON ({error}); pass a {STATE_FILE} written by the Trainer."
        ) from None
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise ValueError(f"{path} holds no log_history list; pass a {STATE_FILE} written by the Trainer.")
    return history


def read_series(log_history: list[dict], source: str = "the log history") -> RunSeries:
    """The run's series from a Trainer's `log_history`: the logs with `adaptive_batch/samples_seen`, evaluations."""
    series = RunSeries(source=source)
    training = [log for log in log_history if isinstance(log, dict) and SAMPLES_SEEN in log]
    if not training:
        raise ValueError(
            f"no {SAMPLES_SEEN} in the log history of {source} ({len(log_history)} logs): was the run trained "
            "with AdaptiveBatch()? Add callbacks=[AdaptiveBatch()] to the Trainer and log at least one step "
            "(logging_steps) before saving."
        )
    for log in training:
        for name, key in TRAINING_KEYS.items():
            getattr(series, name).append(log.get(key))
    anchors = [(0, 0)] + [(log["step"], log[SAMPLES_SEEN]) for log in training if "step" in log]
    for log in log_history:
        if isinstance(log, dict) and "eval_loss" in log and "step" in log:
            series.eval_step.append(log["step"])
            series.eval_samples_seen.append(_samples_at(log["step"], anchors, training[-1]))
            series.eval_loss.append(log["eval_loss"])
    return series


def _samples_at(step: int, anchors: list[tuple[int, int]], last_log: dict) -> float:
    """Samples seen at the end of `step`, interpolated between `anchors`, past the last by its effective batch."""
    for (step_before, samples_before), (step_after, samples_after) in zip(anchors, anchors[1:]):
        if step == step_after:
            return samples_after
        if step_before <= step < step_after:
            share = (step - step_before) / (step_after - step_before)
            return samples_before + share * (samples_after - samples_before)
    last_step, last_samples = anchors[-1]
    return last_samples + (step - last_step) * (last_log.get("adaptive_batch/effective_batch_size") or 0)


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the run in `run_dir` ([`find_trainer_state`]) into the PNG `out` (default: [`default_png`])."""
    return write_png(read_run(run_dir), out if out is not None else default_png(run_dir))


def read_run(run_dir: str | Path) -> RunSeries:
    """The series of the run in `run_dir` ([`find_trainer_state`]), their `source` the file read."""
    state_file = find_trainer_state(run_dir)
    return read_series(load_log_history(state_file), source=str(state_file))


def default_png(run_dir: str | Path) -> Path:
    """`adaptive_batch.png` in the output dir (in the folder of a `trainer_state.json` passed as `run_dir`)."""
    path = Path(run_dir)
    return (path if path.is_dir() else path.parent) / PNG_NAME


def write_png(series: RunSeries, out: str | Path) -> Path:
    """Draw the series ([`draw`]) into the PNG `out` (its folder made if missing); returns its path."""
    figure, out = draw(series), Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png", dpi=DPI)
    return out


def draw(series: RunSeries):
    """A matplotlib `Figure` of the series: four panels sharing the x axis (samples seen), on an Agg canvas."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import LogFormatter
    except ImportError:
        raise ImportError(
            'adaptive-batch plot needs matplotlib, which is not installed; pip install "adaptive-batch[plot]".'
        ) from None
    figure = Figure(figsize=FIGURE_INCHES, dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    batch_axes, noise_axes, lr_axes, loss_axes = figure.subplots(4, 1, sharex=True)
    x = series.samples_seen
    # A training log comes at the end of its step, so a step's sizes hold over the samples up to its x ("pre"
    # steps), starting where the first logged step started.
    steps_x = [x[0] - (series.effective_batch_size[0] or 0), *x]
    effective = _numbers(series.effective_batch_size[:1] + series.effective_batch_size)
    micro = _numbers(series.micro_batch_size[:1] + series.micro_batch_size)
    batch_axes.step(steps_x, effective, where="pre", linewidth=2.5, label="effective batch (all ranks)")
    batch_axes.step(steps_x, micro, where="pre", linestyle="--", label="micro-batch (per rank)")
    tallest = max((size for size in effective + micro if math.isfinite(size)), default=1)
    batch_axes.set(ylabel="samples", ylim=(0, 1.3 * tallest))  # room for the legend above the largest size
    batch_axes.legend(loc="upper left")
    noise_axes.step(steps_x, effective, where="pre", color="C0", linestyle="--", label="effective batch")
    if series.noise_measured:
        noise = [value if _plottable(value) else math.nan for value in series.noise_scale]
        noise_axes.plot(x, noise, color="C2", marker=".", label="noise scale B_simple")
    else:
        noise_axes.text(
            0.5, 0.5, "noise scale not measured", transform=noise_axes.transAxes, ha="center", va="center"
        )
    noise_axes.set(yscale="log", ylabel="samples (log)")
    for axis_formatter in (noise_axes.yaxis.set_major_formatter, noise_axes.yaxis.set_minor_formatter):
        axis_formatter(LogFormatter(labelOnlyBase=False))  # 20, not 2 x 10^1
    noise_axes.legend(loc="upper left")
    lr_axes.plot(x, _numbers(series.learning_rate), color="C3")
    lr_axes.set_ylabel("learning rate")
    loss_axes.plot(x, _numbers(series.loss), color="C1", label="training loss")
    if series.eval_loss:
        # "o": a marker at each evaluation, no line between them
        loss_axes.plot(series.eval_samples_seen, series.eval_loss, "o", color="C4", label="eval loss")
    loss_axes.set(ylabel="loss", xlabel="samples seen")
    loss_axes.legend(loc="upper right")
    for axes in (batch_axes, noise_axes, lr_axes, loss_axes):
        axes.grid(True, alpha=0.3)
    tokens = f", {series.tokens_seen[-1]:,} tokens" if series.tokens_seen[-1] is not None else ""
    figure.suptitle(
        f"{series.source}\n{len(x)} logged steps to step {series.step[-1]}: {x[-1]:,} samples{tokens}",
        fontsize="medium",
    )
    return figure


def _numbers(values: list) -> list[float]:
    """None (a value a log lacks) as NaN, which matplotlib leaves as a gap."""
    return [math.nan if value is None else value for value in values]


def _plottable(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0
