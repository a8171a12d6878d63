"""What runs a session's plan: the controller that cuts the steps, the step runner, the record of measurements and
the evaluation's pieces."""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, fields, replace

from ..core.checkpoint import PlanIdentity, StoredCheckpoint, learned_state_applies
from ..core.config import AdaptiveBatchConfig
from ..core.controllers import Layout, controller_for, waits_for_lengths
from ..core.replay import Tape, differences, file_name, read_record, replay_error
from ..core.steps import StepPlan
from ..runtime import lengths
from ..runtime.compat.trainer import padding_free
from ..runtime.engines import Engine, engine_for
from ..runtime.evaluation import EvalGrowth, EvalPieces
from ..runtime.model_checks import ModelChecks
from ..runtime.noise_hooks import GradientNoiseMeter
from ..runtime.ranks import Ranks
from ..runtime.step import MicroBatchRunner
from .facts import TrainerFacts

logger = logging.getLogger("adaptive_batch")


class Assembly:
    """One Trainer's step machinery, built again for each plan ([`build`]), and its evaluation, built once."""

    def __init__(self, trainer, config: AdaptiveBatchConfig, world_size: int, rank: int):
        self.trainer, self.config, self.world_size, self.rank = trainer, config, world_size, rank
        self.controller = None  # (a second train() without a checkpoint keeps what the first learned)
        self.runner: MicroBatchRunner | None = None
        self.row_limit = 0  # the most rows a step of the plan holds on a rank
        self.lengths_pending = False  # the first step tells the rows' lengths ([`lengths_from_step`])
        # what checks on the model showed, each layout once; under an engine that places the model in train()
        # (DeepSpeed, FSDP2) they wait for the first step ([`check_at_step`])
        self.checks = ModelChecks(trainer, Ranks(trainer, world_size), config.padding_free is True)
        # evaluation survives an out-of-memory error unless adapt_evaluation=False or the engine's forward gathers
        # parameters from every rank (DeepSpeed, FSDP); "grow": the eval batch grows between evaluations
        sharded = any(getattr(trainer, name, False) for name in ("is_deepspeed_enabled", "is_fsdp_enabled"))
        grow = config.adapt_evaluation == "grow"
        self.eval_pieces = self.eval_growth = None
        if config.adapt_evaluation and not sharded:
            self.eval_pieces = EvalPieces(trainer, world_size, cut_by_tokens=grow)
            if grow:
                self.eval_growth = EvalGrowth(
                    trainer, self.eval_pieces, config.growth_margin, config.memory_headroom
                )

    def engine(self) -> Engine:
        return engine_for(self.trainer, self.world_size)

    def build(
        self,
        engine: Engine,
        plan: StepPlan,
        identity: PlanIdentity,
        checkpoint: StoredCheckpoint | None,
        growing: bool,
    ) -> None:
        """The controller (kept unless none yet or a checkpoint resumed), the step runner and the record."""
        self.checks.placed_before_train(engine.model_placed_before_train)
        facts = self._facts(engine)
        if self.controller is None or checkpoint is not None:
            self.lengths_pending = waits_for_lengths(self.config, facts)
            self.controller = controller_for(self.config, facts, plan.max_rows_per_rank)
        measures = self.config.measure_noise and engine.measures_noise
        layout = facts.layout
        self.runner = MicroBatchRunner(
            self.trainer,
            self.controller,
            self.world_size,
            engine,
            packed=padding_free(self.trainer),
            flatten=layout.flatten,
            in_rows=layout.in_rows,
            flatten_stated=self.config.padding_free is True,
            unmasked=(layout.unmasked, facts.causal_rows[1]),
            noise=GradientNoiseMeter(self.config.noise_preconditioner, self.trainer.args.device)
            if measures
            else None,
        )
        self.runner.tape = self._tape(identity, checkpoint, growing)
        if self.eval_pieces is not None:
            self.eval_pieces.tape = self.runner.tape
        self.follow(plan)

    def follow(self, plan: StepPlan) -> None:
        self.row_limit = plan.max_rows_per_rank
        self.controller.set_row_limit(self.row_limit)

    def _tape(self, identity: PlanIdentity, checkpoint: StoredCheckpoint | None, growing: bool) -> Tape:
        """What the decisions read of time and memory: a resumed run's continues its checkpoint's; `replay=PATH` reads
        that record's, refused where another run made it."""
        trainer, config = self.trainer, self.config
        plan = asdict(identity)
        if growing:  # (its changes are restored from a checkpoint: compared by its settings)
            del plan["fingerprint"]
        run = {
            "world_size": self.world_size,
            "device": trainer.args.device.type,
            "plan": plan,
            "settings": {
                f.name: getattr(config, f.name)
                for f in fields(config)
                if f.name not in ("schedule", "lr_scaling", "replay")
            },
            "cut": self.controller.describe(),
            "padding_free_steps": bool(self.runner.flatten),
            "per_device_eval_batch_size": trainer.args.per_device_eval_batch_size,
        }
        recorded = Tape(run)
        saved = os.path.join(checkpoint.path, file_name(self.rank, self.world_size)) if checkpoint else ""
        if os.path.isfile(saved):
            recorded.continue_from(read_record(saved, 0, 1)[0])
        if config.replay is not None:
            record, path = read_record(config.replay, self.rank, self.world_size)
            changed = differences(record.get("run"), run)
            if changed:
                raise ValueError(replay_error(config.replay, changed))
            recorded.replay(record, path)
            recorded.run = record["run"]
        return recorded

    def write_tape(self, folder: str) -> None:
        self.runner.tape.write(os.path.join(folder, file_name(self.rank, self.world_size)))

    def _facts(self, engine: Engine) -> TrainerFacts:
        return TrainerFacts(self.trainer, self.config, engine, self.checks.verdict)

    def layout(self) -> Layout:
        return self._facts(self.runner.engine).layout

    def probed_traps(self) -> list[str]:
        return self._facts(self.runner.engine).probed_traps()

    @property
    def check_pending(self) -> bool:
        return self.checks.pending

    def check_at_step(self) -> None:
        """The first step, where the engine has placed the model: check it for the layout that waited for it."""
        self.checks.pending = False
        facts = self._facts(self.runner.engine)
        if facts.layout.flatten != self.runner.flatten or facts.layout.unmasked != self.runner.unmasked[0]:
            self._relayout(facts)

    def check_longest_row(self) -> None:
        """Warn before any compute where a row is longer than the token budget (a packed row is cut, not warned of)."""
        if self.controller.max_tokens is None or getattr(self.trainer.args, "packing", False):
            return
        self.controller.check_longest_row(lengths.longest(self.trainer.train_dataset))

    def lengths_from_step(self, inputs) -> None:
        """Where the dataset could not tell, the first step's rows do (every rank alike: they agree on them)."""
        row_lengths = lengths.step_row_lengths(inputs) or [0]
        varies, longest = self.runner.ranks.max(
            [float(min(row_lengths) != max(row_lengths)), float(max(row_lengths))]
        )
        if varies:
            flatten = self._choose_from_lengths(int(longest))
            logger.info(
                "AdaptiveBatch: the first step's rows vary in length (the longest %d tokens; the dataset could not tell "
                "before training): steps are %s from here on.",
                int(longest),
                "flattened padding-free" if flatten else "cut by padded tokens",
            )
        self.lengths_pending = False

    def _choose_from_lengths(self, longest_row: int) -> bool:
        """Rows of varying length from now on: flattened where the layout says so (returned), else cut by tokens."""
        facts = self._facts(self.runner.engine)
        facts.observe(True, longest_row)
        return self._relayout(facts)

    def _relayout(self, facts: TrainerFacts) -> bool:
        """The runner and the controller follow the layout `facts` give now; returns whether it flattens."""
        layout = facts.layout
        self.runner.flatten, self.runner.in_rows = layout.flatten, layout.in_rows
        self.runner.unmasked = (layout.unmasked, facts.causal_rows[1])
        self.controller = self.runner.controller = controller_for(self.config, facts, self.row_limit)
        return layout.flatten

    def state_dict(self) -> dict:
        runner = self.runner
        return {
            "micro_batch": self.controller.state_dict() if self.controller else None,
            "last_micro_batch_size": runner.last.micro_batch_size if runner else 0,
            "last_accumulation_steps": runner.last.accumulation_steps if runner else 0,
            "flattened": bool(runner.flatten) if runner else False,
        }

    def load_state_dict(self, state: dict) -> None:
        self.runner.last = replace(
            self.runner.last,
            micro_batch_size=int(state["last_micro_batch_size"]),
            accumulation_steps=int(state["last_accumulation_steps"]),
        )
        learned = state["micro_batch"]
        varied = learned is not None and (learned["kind"] == "tokens" or state.get("flattened"))
        if self.lengths_pending and varied:
            # the run's first step told that its rows vary: padding-free or cut by tokens as then (the budget learned)
            self._choose_from_lengths(longest_row=1)
        self.lengths_pending = False  # (rows: the first step's rows were of one length)
        controller, config = self.controller, self.config
        applies, message = learned_state_applies(state["settings"], config.micro_batch_settings())
        if applies and learned is not None and learned["kind"] != controller.kind:
            # the same settings, another dataset: "auto" cut the checkpoint's run by the other unit
            applies = False
            message = (
                f"Micro-batches: cut by {controller.kind} now; the checkpoint's run cut by {learned['kind']}, and what "
                "it learned is not used."
            )
        if applies and learned is not None:
            controller.load_state_dict(learned)
            controller.limit_to(config.max_micro_batch_size)
        logger.info("%s", message)
