"""`probe`: the largest micro-batch that fits a model and setup, a fast one, and the largest eval batch, found by real
training steps ([`trials.TrialRunner`]) that leave no trace. See docs/how-it-works.md, "The commands"."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from ..runtime.memory import release_memory
from .boundary import (
    Trial,
    find_boundary,
    next_throughput_size,
    recommend,
    split_effective_batch,
    split_reason,
    with_estimated_step,
)
from .trials import Snapshot, TrialRunner, make_optimizer, trial_limit, vocab_size

THROUGHPUT_TRIALS = 3  # trials after the search, to find the smallest size near the best speed


@dataclass
class ProbeReport:
    """What a probe found: sizes in samples per micro-batch on one device; `seconds` = `warm_up_seconds` +
    `trial_seconds` + `overhead_seconds` (`setup_seconds` and `cleanup_seconds` among it)."""

    setup: dict
    seq_len: int
    limit_bytes: float | None
    trials: list[dict]
    boundary: int
    first_failing: int | None
    predicted: int | None
    recommended: int
    recommended_by: str
    boundary_tokens: int
    per_device_train_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    split_reason: str | None = None
    effective_batch_size: int | None = None
    gpus: int = 1
    device: str = ""
    seconds: float = 0.0
    warm_up_seconds: float = 0.0
    warm_up_tokens: int = 0
    trial_seconds: float = 0.0
    overhead_seconds: float = 0.0
    setup_seconds: float = 0.0
    cleanup_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    # the eval batch: the largest that fits a forward without gradients beside the training state (None: not searched)
    eval_boundary: int | None = None
    eval_first_failing: int | None = None
    eval_trials: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def probe(
    model: torch.nn.Module,
    seq_len: int,
    optim: str = "adamw_torch",
    learning_rate: float = 2e-4,
    device: torch.device | str | None = None,
    headroom: float = 0.05,
    memory_budget: float | None = None,
    max_size: int = 4096,
    largest: bool = False,
    effective_batch_size: int | None = None,
    gpus: int = 1,
    autocast_dtype: torch.dtype | None = None,
    setup: dict | None = None,
    on_trial: Callable[[Trial], None] | None = None,
    evaluation: bool = True,
) -> ProbeReport:
    """The boundary and a recommended micro-batch for `model` (as the run will train it) on full-length sequences of
    `seq_len` tokens, with the Trainer's optimizer `optim`; `memory_budget` is required on the CPU."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    limit = trial_limit(device, headroom, memory_budget)
    started = time.perf_counter()
    snapshot = Snapshot(model)
    optimizer = make_optimizer(model, optim, learning_rate)
    runner = TrialRunner(model, optimizer, seq_len, vocab_size(model), device, autocast_dtype, limit)
    setup_seconds = time.perf_counter() - started
    try:
        warm_up = runner.warm_up()
        trials, eval_trials = [], []

        def run(size: int, forward_only: bool = False, eval_step: bool = False) -> Trial:
            trial = runner.run(size, forward_only=forward_only, evaluation=eval_step)
            if forward_only:
                trial = with_estimated_step(trial, trials, limit)
            (eval_trials if eval_step else trials).append(trial)
            if on_trial is not None:
                on_trial(trial)
            return trial

        search = find_boundary(run, limit, max_size=max_size)
        if not largest:
            for _ in range(THROUGHPUT_TRIALS):
                size = next_throughput_size(trials, limit)
                if size is None:
                    break
                run(size, forward_only=True)
        eval_search = None
        if evaluation:
            # where one sample does not fit an eval forward either, the report's eval boundary says 0
            with contextlib.suppress(ValueError):
                eval_search = find_boundary(lambda size: run(size, eval_step=True), limit, max_size=max_size)
    finally:
        cleanup_started = time.perf_counter()
        del optimizer
        runner.close()
        snapshot.restore()
        # no garbage collection: every trial's tensors are freed already, and collecting a large model costs time
        release_memory(device, collect=False)
    finished = time.perf_counter()
    recommended = recommend(trials, limit, largest=largest)
    seconds = finished - started
    warm_up_seconds = warm_up.seconds or 0.0
    # what the trials took: a forward pass alone took its forward's time (its `seconds` is the step's estimate)
    trial_seconds = sum((t.forward_seconds if t.forward_only else t.seconds) or 0.0 for t in trials)
    trial_seconds += sum(t.seconds or 0.0 for t in eval_trials)
    report = ProbeReport(
        setup=setup or {},
        seq_len=seq_len,
        limit_bytes=limit,
        trials=[
            {**t.to_dict(), "fits": t.fits(limit) or (t.forward_only and t.size <= search.boundary)}
            for t in sorted(trials, key=lambda t: t.size)
        ],
        boundary=search.boundary,
        first_failing=search.first_failing,
        predicted=search.predicted,
        recommended=recommended,
        recommended_by="largest that fits" if largest else "smallest within 2% of the best tokens/s",
        boundary_tokens=search.boundary * seq_len,
        gpus=gpus,
        device=device.type,
        seconds=seconds,
        warm_up_seconds=warm_up_seconds,
        warm_up_tokens=warm_up.tokens,
        trial_seconds=trial_seconds,
        overhead_seconds=seconds - warm_up_seconds - trial_seconds,
        setup_seconds=setup_seconds,
        cleanup_seconds=finished - cleanup_started,
        eval_boundary=None if not evaluation else eval_search.boundary if eval_search else 0,
        eval_first_failing=eval_search.first_failing if eval_search else None,
        eval_trials=[
            {**t.to_dict(), "fits": t.fits(limit)} for t in sorted(eval_trials, key=lambda t: t.size)
        ],
    )
    if effective_batch_size is not None:
        report.effective_batch_size = effective_batch_size
        split = split_effective_batch(recommended, effective_batch_size, gpus)
        report.per_device_train_batch_size, report.gradient_accumulation_steps = split
        report.split_reason = split_reason(recommended, effective_batch_size, gpus)
    return report
