"""What a session runs with, built from the Trainer and the settings: the engine, the controller that cuts the steps
(chosen from the facts it reads of the run), the step runner and the noise scale's averages."""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, fields

from ..core.config import AdaptiveBatchConfig
from ..core.controllers import Layout, controller_for, waits_for_lengths
from ..core.microbatch import CutController
from ..core.noise import NoiseScale
from ..core.plain_trainer import PlainBatching
from ..core.replay import Tape, differences, file_name, read_record, replay_error
from ..runtime import lengths
from ..runtime.compat.trainer import padding_free
from ..runtime.engines import Engine, engine_for
from ..runtime.evaluation import EvalGrowth, EvalPieces
from ..runtime.noise_hooks import GradientNoiseMeter
from ..runtime.step import MicroBatchRunner
from .facts import TrainerFacts

logger = logging.getLogger("adaptive_batch")


def engine(trainer, world_size: int) -> Engine:
    return engine_for(trainer, world_size)


def controller(session, engine: Engine) -> CutController:
    """The controller for the session's plan ([`core.controllers.controller_for`]); where the dataset cannot tell
    its rows' lengths, by rows until the first step tells them (`session.lengths_pending`, [`lengths_from_step`])."""
    facts = TrainerFacts(session.trainer, session.config, engine, session.per_device_train_batch_size)
    session.lengths_pending = waits_for_lengths(session.config, facts)
    return controller_for(session.config, facts, session.plan.max_rows_per_rank)


def plain_batching(session) -> PlainBatching:
    """The plain Trainer at the user's batch settings, over the plan's dataset."""
    return PlainBatching(
        session.plan.dataset_size,
        session.per_device_train_batch_size,
        session.gradient_accumulation_steps,
        session.world_size,
        bool(session.trainer.args.dataloader_drop_last),
    )


def probed_traps(session) -> list[str]:
    """A stated micro-batch or eval batch above what `adaptive-batch probe` found to fit for this setup."""
    facts = TrainerFacts(
        session.trainer, session.config, session.runner.engine, session.per_device_train_batch_size
    )
    return facts.probed_traps()


def lengths_from_step(session, inputs) -> None:
    """The first step's rows tell their lengths where the dataset could not: rows that vary are run as the
    dataset's lengths would have chosen from this step on, padding-free or cut by padded tokens (every rank alike:
    they agree on the longest row and on whether any rank's rows vary)."""
    row_lengths = lengths.step_row_lengths(inputs) or [0]
    varies, longest = session.runner.agree(
        [float(min(row_lengths) != max(row_lengths)), float(max(row_lengths))]
    )
    if varies:
        flatten = choose_from_lengths(session, int(longest))
        logger.info(
            "AdaptiveBatch: the first step's rows vary in length (the longest %d tokens; the dataset could not tell "
            "before training): steps are %s from here on.",
            int(longest),
            "flattened padding-free" if flatten else "cut by padded tokens",
        )
    session.lengths_pending = False


def choose_from_lengths(session, longest_row: int) -> bool:
    """Rows of varying length from now on: padding-free where the layout says so, else cut by padded tokens with a
    budget starting at the starting size x `longest_row`. Returns whether steps are flattened."""
    engine = session.runner.engine
    facts = TrainerFacts(session.trainer, session.config, engine, session.per_device_train_batch_size)
    facts.observe(True, longest_row)
    session.runner.flatten = facts.layout.flatten
    session.controller = session.runner.controller = controller_for(
        session.config, facts, session.plan.max_rows_per_rank
    )
    return facts.layout.flatten


def layout(session, engine: Engine | None = None) -> Layout:
    """How the session's padding collator's steps run ([`core.controllers.choose_layout`])."""
    engine = engine or session.runner.engine
    return TrainerFacts(session.trainer, session.config, engine, session.per_device_train_batch_size).layout


def runner(session, engine: Engine) -> MicroBatchRunner:
    trainer, config = session.trainer, session.config
    measures = config.measure_noise and engine.measures_noise
    return MicroBatchRunner(
        trainer,
        session.controller,
        session.world_size,
        engine,
        packed=padding_free(trainer),
        flatten=layout(session, engine).flatten,
        noise=GradientNoiseMeter(config.noise_preconditioner, trainer.args.device) if measures else None,
    )


def noise_averages(config: AdaptiveBatchConfig) -> NoiseScale | None:
    return NoiseScale(config.noise_time_constant_samples) if config.measure_noise else None


def check_longest_row(session) -> None:
    """Warn before any compute when the dataset holds a row longer than a token budget (it will run alone); a packed
    row is cut between its sequences."""
    if session.controller.max_tokens is None or getattr(session.trainer.args, "packing", False):
        return
    session.controller.check_longest_row(lengths.longest(session.trainer.train_dataset))


def eval_pieces(trainer, config: AdaptiveBatchConfig, world_size: int) -> EvalPieces | None:
    """Evaluation that survives an out-of-memory error ([`runtime.evaluation`]), unless `adapt_evaluation=False`
    or the engine's forward gathers parameters from every rank (DeepSpeed, FSDP): there the Trainer's own."""
    sharded = getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False)
    if not config.adapt_evaluation or sharded:
        return None
    return EvalPieces(trainer, world_size, cut_by_tokens=config.adapt_evaluation == "grow")


def eval_growth(trainer, config: AdaptiveBatchConfig, pieces: EvalPieces | None) -> EvalGrowth | None:
    """The eval batch grown between evaluations, under `adapt_evaluation="grow"` (where evaluation runs in pieces
    after an out-of-memory error: a batch grown too far must survive)."""
    if config.adapt_evaluation != "grow" or pieces is None:
        return None
    return EvalGrowth(trainer, pieces, config.growth_margin, config.memory_headroom)


def tape(session, checkpoint) -> Tape:
    """The session's record of what its decisions read of time and memory ([`core.replay`]), handed to the step
    runner and the evaluation: a resumed run's continues its checkpoint's; with `replay=PATH` the measurements come
    from that record, refused before any compute where it was made by another run."""
    trainer, config = session.trainer, session.config
    identity = asdict(session.identity)
    if session.growth is not None:  # (its changes are restored from a checkpoint: compared by its settings)
        del identity["fingerprint"]
    run = {
        "world_size": session.world_size,
        "device": trainer.args.device.type,
        "plan": identity,
        "settings": {
            f.name: getattr(config, f.name)
            for f in fields(config)
            if f.name not in ("schedule", "lr_scaling", "replay")
        },
        "cut": session.controller.describe(),
        "padding_free_steps": bool(session.runner.flatten),
        "per_device_eval_batch_size": trainer.args.per_device_eval_batch_size,
    }
    recorded = Tape(run)
    name = file_name(session.rank, session.world_size)
    if checkpoint is not None and os.path.isfile(os.path.join(checkpoint.path, name)):
        recorded.continue_from(read_record(os.path.join(checkpoint.path, name), 0, 1)[0])
    if config.replay is not None:
        record, path = read_record(config.replay, session.rank, session.world_size)
        changed = differences(record.get("run"), run)
        if changed:
            raise ValueError(replay_error(config.replay, changed))
        recorded.replay(record, path)
        recorded.run = record["run"]
    session.runner.tape = recorded
    if session.eval_pieces is not None:
        session.eval_pieces.tape = recorded
    return recorded


def write_tape(session, folder: str) -> None:
    """This process's record of measurements into `folder` (a checkpoint's, or the output_dir at the end)."""
    session.runner.tape.write(os.path.join(folder, file_name(session.rank, session.world_size)))
