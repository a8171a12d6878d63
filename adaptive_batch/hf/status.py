"""What a session reports: the `adaptive_batch/*` metrics of every training log, `AdaptiveBatch.current()` and the
plan table logged when training starts."""

from __future__ import annotations

import math

from ..core import report
from ..core.schedule import describe
from ..runtime import lengths
from . import assemble


def metrics(session) -> dict[str, float]:
    """The `adaptive_batch/*` values after the last optimizer step: the step's own, and the noise scale's averages
    where that step measured it ([`noise_metrics`])."""
    return {**step_metrics(session), **noise_metrics(session)}


def step_metrics(session) -> dict[str, float]:
    """The last optimizer step's sizes and the run's counters, for every training log."""
    step, plan, last = session.last_step, session.plan, session.runner.last
    values = {
        "adaptive_batch/effective_batch_size": plan.sizes[step],
        "adaptive_batch/micro_batch_size": last.micro_batch_size,
        "adaptive_batch/accumulation_steps": last.accumulation_steps,
        "adaptive_batch/samples_seen": plan.samples_before_step[step + 1],
        "adaptive_batch/tokens_seen": session.tokens_seen,
        "adaptive_batch/lr_scale": session.run.clock.scale(step),
    }
    if session.growth is not None:  # a NoiseScaleSchedule: what the run's samples teach, modelled
        samples = plan.samples_before_step[step + 1]
        values["adaptive_batch/statistical_efficiency"] = session.growth.schedule.run_efficiency(samples)
    return values


def noise_metrics(session) -> dict[str, float]:
    """The noise scale's averages, only where the last step measured it and was averaged in, and only the finite
    ones.

    A step that measured nothing (one micro-batch on one process) logs none of them: repeating the last values would
    plot points that were never measured. `noise_scale` is `inf` while the averaged |G|^2 is not positive (the
    gradient not yet told apart from its noise); such a log leaves it out and keeps the two averages, which say why.
    """
    noise, measured = session.noise, session.runner.last.noise
    if noise is None or measured is None or not noise.last_averaged:
        return {}
    values = {
        "adaptive_batch/noise_scale": noise.value,
        "adaptive_batch/grad_norm_sq": noise.grad_norm_sq,
        "adaptive_batch/grad_variance": noise.grad_variance,
    }
    return {key: value for key, value in values.items() if math.isfinite(value)}


def noise_averages(noise) -> dict:
    """The noise scale's averages as they stand, for `current()`, whether or not the last step measured: `None`
    before any step did (and with `measure_noise=False`), `noise_scale` `inf` while the averaged |G|^2 is not
    positive; and `noise_steps`, the steps averaged."""
    if noise is None:
        return {"noise_scale": None, "grad_norm_sq": None, "grad_variance": None, "noise_steps": 0}
    return {
        "noise_scale": noise.value,
        "grad_norm_sq": noise.grad_norm_sq,
        "grad_variance": noise.grad_variance,
        "noise_steps": noise.steps,
    }


def current(session) -> dict:
    """Where the run stands after its last optimizer step (before the first: what step 0 will run)."""
    plan, controller = session.plan, session.controller
    if session.last_step < 0:
        first = plan.done_steps
        size = controller.first_micro_batch_size  # (None: decided by the first step's lengths)
        values = {
            "effective_batch_size": plan.sizes[first],
            "micro_batch_size": None if size is None else min(size, plan.max_rows(first)),
            "samples_seen": plan.samples_before_step[first],
            "tokens_seen": session.tokens_seen,
            "lr_scale": session.run.clock.scale(first),
        }
    else:
        values = {key.split("/", 1)[1]: value for key, value in step_metrics(session).items()}
    values.update(noise_averages(session.noise))
    values["step"] = session.last_step + 1
    values["cut_by"] = controller.kind
    values["max_tokens_per_micro_batch"] = controller.max_tokens
    values["micro_batch_settled_because"] = controller.settled_because
    values["micro_batch_settled_at_step"] = session.settled_at_step
    values["batch_changes"] = [
        {"step": c.step, "size": c.size, "samples_seen": c.samples_seen, "reason": c.reason}
        for c in (session.growth.schedule.changes if session.growth is not None else [])
    ]
    return values


def plan_table(session) -> str:
    """The plan table as logged when training starts."""
    return report.format_rows("AdaptiveBatch plan", plan_rows(session))


def plan_rows(session) -> list[tuple[str, str]]:
    """The plan as (label, value) rows: what the log shows when training starts."""
    config, controller, run, args = session.config, session.controller, session.run, session.trainer.args
    plan = run.plan
    plain = assemble.plain_batching(session)
    total_tokens = lengths.total_tokens(session.trainer.train_dataset)
    rows = report.plan_rows(
        plan,
        run.clock,
        run.budget,
        schedule_text=schedule_text(session),
        micro_batch_text=controller.describe()
        + (
            "; the dataset cannot tell its rows' lengths before training: where the first step's vary, steps are "
            "cut by padded tokens from it on"
            if session.lengths_pending
            else ""
        ),
        plain_steps=plain.total_steps(args.num_train_epochs, args.max_steps),
        tokens=None if total_tokens is None else round(total_tokens * run.budget.samples / plan.dataset_size),
        rule_text=rule_text(config.lr_scaling),
        accumulation_text=controller.accumulation_text(
            [effective // plan.world_size for _, _, effective in plan.phases()],
            session.gradient_accumulation_steps,
        ),
        layout_text=assemble.layout(session).text,
    )
    rows += report.step_strategy_rows(
        plan,
        plain,
        plain.total_steps(args.num_train_epochs, args.max_steps),
        step_strategies(args),
        may_grow_to=session.growth.schedule.max_size if session.growth is not None else None,
    )
    if session.is_stream:
        stream = ("epochs", f"a stream: its first {plan.budget:,} samples, read once in order")
        rows = [stream if label == "epochs" else (label, value) for label, value in rows]
    return rows


def step_strategies(args) -> list[report.StepStrategy]:
    """Evaluation and saving by steps, where the Trainer's arguments ask for them."""
    strategies = []
    if args.eval_strategy == "steps":
        strategies.append(
            report.StepStrategy(
                "evaluation", "eval_steps", "eval_strategy", args.eval_steps, args.eval_delay or 0
            )
        )
    if args.save_strategy == "steps":
        strategies.append(report.StepStrategy("saving", "save_steps", "save_strategy", args.save_steps))
    return strategies


# The schedule and the LR rule as the plan table names them; a checkpoint's plan records the same words, so a resume
# under another one is refused naming both.


def schedule_text(session) -> str:
    """The session's schedule described (a growing one by its settings, not the changes it made)."""
    return describe(session.schedule)


def rule_text(lr_scaling) -> str:
    """The LR rule's name, or a callable rule's description."""
    return lr_scaling if isinstance(lr_scaling, str) else describe(lr_scaling)
