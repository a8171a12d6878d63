"""`probe`: the largest micro-batch that fits a model and setup, and the fastest one, before a run.

Each trial of the search is a real training step on a full-length batch (forward, backward, the optimizer the run
will use),
timed with the device synchronised and its peak memory read: on a GPU from the caching allocator (reserved bytes
are what the limit applies to, allocated bytes are reported too), on the CPU from a dispatch-mode meter of the
bytes every tensor op allocates, against a stated budget. A warm-up step on one short sample pays the one-time
costs first (kernels, allocator, the optimizer's state). Memory is released between trials, and the model's
trainable weights and the RNG states are put back as they were afterwards: the probe leaves no trace.

The search ([`boundary.find_boundary`]) needs about five trials when memory grows affinely with the batch; the
recommendation is the smallest size within 2% of the best tokens/s, predicted by an affine fit of step time and
confirmed by the forward pass of one more step (scaled to a whole step by the boundary trial's ratio). The trials themselves are run by
[`trials.TrialRunner`]; the report is cached by [`probe_cache.save_report`].

Example:
    ```python
    report = probe(model, seq_len=1024, optim="paged_adamw_8bit", effective_batch_size=64)
    report.boundary, report.recommended, report.per_device_train_batch_size, report.gradient_accumulation_steps
    ```
"""

from __future__ import annotations

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
    """What a probe found. Sizes are samples per micro-batch on one device; tokens are `size x seq_len`.

    Where the time went: `seconds` in all, of which `warm_up_seconds` for the warm-up step (one sample of
    `warm_up_tokens`), `trial_seconds` for the trials (a stopped trial's until it stopped, a forward-only one's
    forward) and
    `overhead_seconds` for the rest: `setup_seconds` before the warm-up (the snapshot and the optimizer),
    `cleanup_seconds` after the last trial (putting the snapshot back, releasing memory), and between trials their
    input batches and the memory released after each.
    """

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
    """Find the boundary and a recommended micro-batch for `model` on sequences of `seq_len` tokens.

    Args:
        model: the model as the run will train it (quantised, with adapters, checkpointing enabled).
        seq_len: tokens per sample; every trial batch is full length (the warm-up's one sample is short).
        optim: a `TrainingArguments.optim` name; the probe builds that optimizer as the Trainer would.
        device: where the model is; default: the device of its first parameter.
        headroom: on a GPU, the share of device memory to keep free (the limit is `(1 - headroom) x total`).
        memory_budget: on the CPU, the bytes a step may use (required there).
        max_size: the largest size to consider.
        largest: recommend the boundary instead of the fastest size.
        effective_batch_size, gpus: also give the `per_device x accumulation` pair for this effective batch.
        autocast_dtype: run forward and backward under `torch.autocast` with this dtype (as `bf16=True` does).
        setup: what identifies the setup (for the report and the cache).
        on_trial: called after every trial (for a progress bar).
        evaluation: search the largest eval batch too (a forward without gradients, its logits held, beside the
            training state: what an evaluation during training has), for `per_device_eval_batch_size`.
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    limit = trial_limit(device, headroom, memory_budget)
    started = time.perf_counter()
    snapshot = Snapshot(model)
    optimizer = make_optimizer(model, optim, learning_rate)
    runner = TrialRunner(model, optimizer, seq_len, vocab_size(model), device, autocast_dtype, limit)
    setup_seconds = time.perf_counter() - started
    try:
        warm_up = runner.warm_up()
        trials: list[Trial] = []

        def run(size: int, forward_only: bool = False) -> Trial:
            trial = runner.run(size, forward_only=forward_only)
            if forward_only:
                trial = with_estimated_step(trial, trials, limit)
            trials.append(trial)
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
        eval_trials: list[Trial] = []
        eval_search = None
        if evaluation:

            def run_eval(size: int) -> Trial:
                trial = runner.run(size, evaluation=True)
                eval_trials.append(trial)
                if on_trial is not None:
                    on_trial(trial)
                return trial

            try:
                eval_search = find_boundary(run_eval, limit, max_size=max_size)
            except (
                ValueError
            ):  # one sample does not fit an eval forward either: said by the boundary of 0 below
                eval_search = None
    finally:
        cleanup_started = time.perf_counter()
        del optimizer
        runner.close()
        snapshot.restore()
        # no garbage collection: a trial that ran to the end freed its tensors, and one cut short was collected
        # right after it; collecting a large model's objects again would only cost time
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
        report.per_device_train_batch_size, report.gradient_accumulation_steps = split_effective_batch(
            recommended, effective_batch_size, gpus
        )
        report.split_reason = split_reason(recommended, effective_batch_size, gpus)
    return report
