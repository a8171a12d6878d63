"""What a session reports: the `adaptive_batch/*` metrics of every training log, `AdaptiveBatch.current()` and the
plan table logged when training starts."""

from __future__ import annotations

from ..core import report
from ..core.plain_trainer import PlainBatching
from ..core.schedule import describe
from ..runtime import lengths


def metrics(session) -> dict[str, float]:
    """The `adaptive_batch/*` values after the last optimizer step."""
    step, plan, last = session.last_step, session.plan, session.runner.last
    return {
        "adaptive_batch/effective_batch_size": plan.sizes[step],
        "adaptive_batch/micro_batch_size": last.micro_batch_size,
        "adaptive_batch/accumulation_steps": last.accumulation_steps,
        "adaptive_batch/samples_seen": plan.samples_before_step[step + 1],
        "adaptive_batch/tokens_seen": session.tokens_seen,
        "adaptive_batch/lr_scale": session.run.clock.scale(step),
        **noise_metrics(session.noise),
    }


def noise_metrics(noise) -> dict[str, float]:
    """The gradient noise scale's values, once a step has measured it."""
    if noise is None or noise.value is None:
        return {}
    return {
        "adaptive_batch/noise_scale": noise.value,
        "adaptive_batch/grad_norm_sq": noise.grad_norm_sq,
        "adaptive_batch/grad_variance": noise.grad_variance,
    }


def current(session) -> dict:
    """Where the run stands after its last optimizer step (before the first: what step 0 will run)."""
    plan, controller = session.plan, session.controller
    if session.last_step < 0:
        first = plan.done_steps
        values = {
            "effective_batch_size": plan.sizes[first],
            "micro_batch_size": controller.first_micro_batch_size,
            "samples_seen": plan.samples_before_step[first],
            "tokens_seen": session.tokens_seen,
            "lr_scale": session.run.clock.scale(first),
        }
    else:
        values = {key.split("/", 1)[1]: value for key, value in metrics(session).items()}
    values["step"] = session.last_step + 1
    values["cut_by"] = controller.kind
    values["max_tokens_per_micro_batch"] = controller.max_tokens
    values["micro_batch_settled_because"] = controller.settled_because
    values["micro_batch_settled_at_step"] = session.settled_at_step
    values["noise_steps"] = session.noise.steps if session.noise is not None else 0
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
    plain = PlainBatching(
        plan.dataset_size,
        session.per_device_train_batch_size,
        session.gradient_accumulation_steps,
        session.world_size,
        bool(args.dataloader_drop_last),
    )
    total_tokens = lengths.total_tokens(session.trainer.train_dataset)
    rows = report.plan_rows(
        plan,
        run.clock,
        run.budget,
        schedule_text=describe(session.schedule),
        micro_batch_text=controller.describe(),
        plain_steps=plain.total_steps(args.num_train_epochs, args.max_steps),
        tokens=None if total_tokens is None else round(total_tokens * run.budget.samples / plan.dataset_size),
        rule_text=config.lr_scaling if isinstance(config.lr_scaling, str) else describe(config.lr_scaling),
        accumulation_text=controller.accumulation_text(
            [effective // plan.world_size for _, _, effective in plan.phases()],
            session.gradient_accumulation_steps,
        ),
    )
    if session.is_stream:
        stream = ("epochs", f"a stream: its first {plan.budget:,} samples, read once in order")
        rows = [stream if label == "epochs" else (label, value) for label, value in rows]
    return rows
