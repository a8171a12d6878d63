"""What a session runs with, built from the Trainer and the settings: the engine, the controller that cuts the steps
(chosen from the facts it reads of the run), the step runner and the noise scale's averages."""

from __future__ import annotations

from ..core.config import AdaptiveBatchConfig
from ..core.controllers import controller_for
from ..core.microbatch import CutController
from ..core.noise import NoiseScale
from ..runtime import compat, lengths
from ..runtime.engines import Engine, engine_for
from ..runtime.noise_hooks import GradientNoiseMeter
from ..runtime.step import MicroBatchRunner
from .facts import TrainerFacts


def engine(trainer, world_size: int) -> Engine:
    return engine_for(trainer, world_size)


def controller(session, engine: Engine) -> CutController:
    """The controller for the session's plan ([`core.controllers.controller_for`])."""
    facts = TrainerFacts(session.trainer, session.config, engine, session.per_device_train_batch_size)
    return controller_for(session.config, facts, session.plan.max_rows_per_rank)


def runner(session, engine: Engine) -> MicroBatchRunner:
    trainer, config = session.trainer, session.config
    measures = config.measure_noise and engine.measures_noise
    return MicroBatchRunner(
        trainer,
        session.controller,
        session.world_size,
        engine,
        packed=compat.padding_free(trainer),
        flatten=config.padding_free,
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
