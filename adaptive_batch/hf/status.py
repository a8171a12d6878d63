"""What a session reports from its counters: the `adaptive_batch/*` metrics, `AdaptiveBatch.current()`, the plan table."""

from __future__ import annotations

import math

from ..core import report
from ..core.config import AdaptiveBatchConfig
from ..core.noise import NoiseScale
from ..core.planning import RunPlan
from ..core.schedule import describe
from ..core.steps import StepPlan
from ..runtime import lengths
from ..runtime.stream import is_stream
from .assemble import Assembly
from .resume import plain_batching


class Status:
    """A run's counters (tokens seen, the last step, where the micro-batch settled) and the noise scale's averages."""

    def __init__(self, trainer, config: AdaptiveBatchConfig, assembly: Assembly):
        self.trainer, self.config, self.assembly = trainer, config, assembly
        self.start(resumed=False)

    def start(self, resumed: bool) -> None:
        """A run starts: its counters from zero, unless a checkpoint's are restored after this."""
        if not resumed:
            # (`settled_at_step`: the first step run after the controller stopped measuring)
            self.tokens_seen, self.last_step, self.settled_at_step = 0, -1, None
        config = self.config
        self.noise = NoiseScale(config.noise_time_constant_samples) if config.measure_noise else None

    def adopt(self, global_step: int) -> None:
        self.tokens_seen, self.last_step = 0, global_step - 1

    def state_dict(self) -> dict:
        return {
            "tokens_seen": self.tokens_seen,
            "last_step": self.last_step,
            "settled_at_step": self.settled_at_step,
            "noise": self.noise.state_dict() if self.noise is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self.tokens_seen, self.last_step = int(state["tokens_seen"]), int(state["last_step"])
        self.settled_at_step = state["settled_at_step"]
        if self.noise is not None and state["noise"]:
            self.noise.load_state_dict(state["noise"])

    def after_step(self, step: int, plan: StepPlan, exploring: bool) -> None:
        """Count the step just run (`exploring`: the controller was measuring before it); average in its noise."""
        runner = self.assembly.runner
        self.tokens_seen += runner.last.real_tokens
        self.last_step = step
        if self.settled_at_step is None and not self.assembly.controller.exploring:
            self.settled_at_step = step if not exploring else step + 1
        measured = runner.last.noise
        if self.noise is None or measured is None:
            return
        samples = plan.sizes[step]
        estimate = measured.sums.estimate(measured.step_norm_sq, samples)
        if not self.noise.update(estimate, samples, plan.samples_before_step[step + 1]):
            runner.noise.warn_once(
                "non-finite",
                f"Step {step}'s gradient noise estimates are not finite (|G|^2={estimate.grad_norm_sq}, "
                f"tr(Sigma)={estimate.grad_variance}; an fp16 overflow, or a NaN loss): such steps are left out of "
                "the noise scale's averages.",
            )

    def metrics(self, run: RunPlan, growth) -> dict[str, float]:
        """The `adaptive_batch/*` values of a training log (README, "What it logs")."""
        values = self._step_metrics(run, growth)
        noise, measured = self.noise, self.assembly.runner.last.noise
        if noise is None or measured is None or not noise.last_averaged:
            return values
        averages = {
            "adaptive_batch/noise_scale": noise.value,
            "adaptive_batch/grad_norm_sq": noise.grad_norm_sq,
            "adaptive_batch/grad_variance": noise.grad_variance,
        }
        return values | {key: value for key, value in averages.items() if math.isfinite(value)}

    def _step_metrics(self, run: RunPlan, growth) -> dict[str, float]:
        step, plan, last = self.last_step, run.plan, self.assembly.runner.last
        values = {
            "adaptive_batch/effective_batch_size": plan.sizes[step],
            "adaptive_batch/micro_batch_size": last.micro_batch_size,
            "adaptive_batch/accumulation_steps": last.accumulation_steps,
            "adaptive_batch/samples_seen": plan.samples_before_step[step + 1],
            "adaptive_batch/tokens_seen": self.tokens_seen,
            "adaptive_batch/lr_scale": run.clock.scale(step),
        }
        if growth is not None:  # a NoiseScaleSchedule: what the run's samples teach, modelled
            samples = plan.samples_before_step[step + 1]
            values["adaptive_batch/statistical_efficiency"] = growth.schedule.run_efficiency(samples)
        return values

    def current(self, run: RunPlan, growth) -> dict:
        plan, controller, noise = run.plan, self.assembly.controller, self.noise
        if self.last_step < 0:
            first = plan.done_steps
            size = controller.first_micro_batch_size  # (None: decided by the first step's lengths)
            values = {
                "effective_batch_size": plan.sizes[first],
                "micro_batch_size": None if size is None else min(size, plan.max_rows(first)),
                "samples_seen": plan.samples_before_step[first],
                "tokens_seen": self.tokens_seen,
                "lr_scale": run.clock.scale(first),
            }
        else:
            values = {key.split("/", 1)[1]: value for key, value in self._step_metrics(run, growth).items()}
        # the averages as they stand, whether or not the last step measured (None before any step did)
        values["noise_scale"] = noise.value if noise is not None else None
        values["grad_norm_sq"] = noise.grad_norm_sq if noise is not None else None
        values["grad_variance"] = noise.grad_variance if noise is not None else None
        values["noise_steps"] = noise.steps if noise is not None else 0
        values["step"] = self.last_step + 1
        values["cut_by"] = controller.kind
        values["max_tokens_per_micro_batch"] = controller.max_tokens
        values["micro_batch_settled_because"] = controller.settled_because
        values["micro_batch_settled_at_step"] = self.settled_at_step
        values["batch_changes"] = [
            {"step": c.step, "size": c.size, "samples_seen": c.samples_seen, "reason": c.reason}
            for c in (growth.schedule.changes if growth is not None else [])
        ]
        return values

    def plan_rows(self, run: RunPlan, growth, schedule) -> list[tuple[str, str]]:
        config, controller, args, plan = self.config, self.assembly.controller, self.trainer.args, run.plan
        plain = plain_batching(args, plan)
        plain_steps = plain.total_steps(args.num_train_epochs, args.max_steps)
        total_tokens = lengths.total_tokens(self.trainer.train_dataset)
        per_rank = [effective // plan.world_size for _, _, effective in plan.phases()]
        unknown_lengths = (
            "; the dataset cannot tell its rows' lengths before training: where the first step's vary, steps are "
            "cut by padded tokens from it on"
        )
        rows = report.plan_rows(
            run,
            schedule_text=plan_text(schedule),
            micro_batch_text=controller.describe()
            + (unknown_lengths if self.assembly.lengths_pending else ""),
            plain_steps=plain_steps,
            tokens=total_tokens and round(total_tokens * run.budget.samples / plan.dataset_size),
            rule_text=plan_text(config.lr_scaling),
            accumulation_text=controller.accumulation_text(per_rank, args.gradient_accumulation_steps),
            layout_text=self.assembly.layout().text,
        )
        may_grow_to = growth.schedule.max_size if growth is not None else None
        rows += report.step_strategy_rows(plan, plain, plain_steps, step_strategies(args), may_grow_to)
        if is_stream(self.trainer.train_dataset):
            stream = ("epochs", f"a stream: its first {plan.budget:,} samples, read once in order")
            rows = [stream if label == "epochs" else (label, value) for label, value in rows]
        return rows


def step_strategies(args) -> list[report.StepStrategy]:
    strategies = []
    if args.eval_strategy == "steps":
        delay = args.eval_delay or 0
        strategies.append(
            report.StepStrategy("evaluation", "eval_steps", "eval_strategy", args.eval_steps, delay)
        )
    if args.save_strategy == "steps":
        strategies.append(report.StepStrategy("saving", "save_steps", "save_strategy", args.save_steps))
    return strategies


def plan_table(rows: list[tuple[str, str]]) -> str:
    return report.format_rows("AdaptiveBatch plan", rows)


def plan_text(value) -> str:
    """The schedule or LR rule as the plan table and a checkpoint's plan name it (a growing schedule by its settings)."""
    return value if isinstance(value, str) else describe(value)
