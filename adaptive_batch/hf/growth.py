"""Growing the effective batch during training by goodput: the driver of a [`core.goodput.NoiseScaleSchedule`]. See
docs/how-it-works.md, "An effective batch chosen by goodput"."""

from __future__ import annotations

import logging
import time

from ..core.goodput import NoiseScaleSchedule, StepCosts, StepTimeModel
from ..core.planning import RunPlan
from ..core.schedule import Progress
from ..runtime.engines import Engine

logger = logging.getLogger("adaptive_batch")


def growth_for(schedule) -> Growth | None:
    return Growth(schedule) if isinstance(schedule, NoiseScaleSchedule) else None


class Growth:
    """Times each step, cuts one in two now and then to measure the noise scale, asks if a larger batch pays."""

    def __init__(self, schedule: NoiseScaleSchedule):
        self.schedule = schedule
        self.step_time = StepTimeModel()
        # (start of the last step, what it ran: rows and micro-batches, None where it is not to be timed)
        self._timing: tuple[float, tuple[int, int] | None] | None = None
        # a step's micro-batches on a rank, outside the steps cut in two to measure
        self._usual_micro_batches = 1

    def check(self, config, engine: Engine, world_size: int, stream_workers: int, state: dict | None) -> None:
        """The schedule's requirements; its changes: none, or those of a checkpoint's `state`."""
        schedule = self.schedule
        if not config.measure_noise:
            raise ValueError(
                "schedule=NoiseScaleSchedule(...) decides by the gradient noise scale, but measure_noise=False turns "
                "its measurement off. Leave measure_noise=True (the default), or use a PhaseSchedule."
            )
        if not engine.measures_noise:
            raise ValueError(
                f"schedule=NoiseScaleSchedule(...) decides by the gradient noise scale, which is not measured under "
                f"{engine.name}. Use a PhaseSchedule, or train under DDP."
            )
        if schedule.start % world_size:
            raise ValueError(
                f"NoiseScaleSchedule start={schedule.start} is not divisible by world_size={world_size}: every rank "
                f"must take the same share. Use {schedule.start // world_size * world_size or world_size} or a "
                "multiple of the world size."
            )
        if stream_workers > 0:
            raise ValueError(
                f"NoiseScaleSchedule with a training stream and dataloader_num_workers={stream_workers}: the stream "
                "is read in a worker process, which a new plan cannot reach after a change. Use "
                "dataloader_num_workers=0, or a map-style dataset."
            )
        schedule.reset()
        if state and state["schedule"]:
            schedule.load_state_dict(state["schedule"])

    def check_sizes(self, run: RunPlan, world_size: int) -> None:
        largest = self.schedule.sizes(world_size)[-1]
        if largest > run.dataset_size:
            raise ValueError(
                f"NoiseScaleSchedule may grow the effective batch to {largest}, more than the dataset's "
                f"{run.dataset_size} {run.settings.unit}: one optimizer step cannot hold more than one epoch. Use "
                f"max_size <= {run.dataset_size}."
            )
        for size in self.schedule.sizes(world_size):
            run.clock.multiplier(size)

    def before_step(self, step: int, last_step: int, tape) -> None:
        """Time the last step, from its start to this one's (optimizer step, logging, data loading included)."""
        now, measured = time.perf_counter(), None
        if self._timing is not None and self._timing[1] is not None and step == last_step + 1:
            rows, micro_batches = self._timing[1]
            measured = [rows, micro_batches, now - self._timing[0]]
        timed = tape.keyed("growth", step, measured)
        if timed is not None:
            self.step_time.record(int(timed[0]), int(timed[1]), float(timed[2]))
        self._timing = (now, None)

    def split(self, session, step: int) -> bool:
        schedule = self.schedule
        if session.world_size != 1:
            return False
        every = schedule.measure_every  # (checked first: the step time model is fitted only on such steps)
        if not every or step % every != every - 1:
            return False
        current = schedule(Progress(self._first_undrawn(session, step), 0, 0.0))
        return bool(schedule.cut_every(current, self._costs(session)))

    def after_step(self, session, step: int, timed: bool, split: bool) -> None:
        last = session.assembly.runner.last
        ran = (session.plan.max_rows(step), last.accumulation_steps) if timed else None
        self._timing = (self._timing[0], ran)
        if not split:
            self._usual_micro_batches = last.accumulation_steps
        self._maybe_grow(session, step)

    def _first_undrawn(self, session, step: int) -> int:
        """Where a change made now takes effect: the first step the loader has not drawn, not before the last change."""
        first = (session.sampler.issued if session.sampler is not None else step) + 1
        if self.schedule.changes:  # (a change may already wait in steps the loader has not drawn)
            first = max(first, self.schedule.changes[-1].step + 1)
        return first

    def _maybe_grow(self, session, step: int) -> None:
        schedule, plan, runner = self.schedule, session.plan, session.assembly.runner
        first = self._first_undrawn(session, step)
        # the size decided last: steps drawn before it took effect still run the one before
        current, samples = schedule(Progress(first, 0, 0.0)), plan.samples_before_step[step + 1]
        noise = session.noise.lower_bound(schedule.confidence_z)
        proposal = schedule.propose(current, samples, noise, self._costs(session), budget=plan.budget)
        size, reason = proposal if proposal is not None else (0, "")
        if runner.ranks.distributed:
            # timings differ between ranks: the largest proposal holds for all, from the latest undrawn step
            size, first = (int(x) for x in runner.ranks.max([size, first]))
            if size and not reason:
                reason = "another rank's step times"
        if not size or first >= plan.num_steps:
            return
        change = schedule.change(first, size, samples, reason, session.noise.value)
        new = session.replan(schedule)
        if new.sizes[:first] != plan.sizes[:first] or new.starts[:first] != plan.starts[:first]:
            raise RuntimeError("A new plan changed steps already drawn; this is a bug in AdaptiveBatch.")
        if session.trainer.args.should_log:
            logger.info(
                f"AdaptiveBatch: effective batch {current} -> {size} from step {first} (after {samples:,} samples): "
                f"{change.reason}; {new.num_steps} steps in all now."
            )

    def _costs(self, session) -> StepCosts:
        last_size = session.assembly.runner.last.micro_batch_size
        cap = session.controller.larger_step_cap(last_size, self._usual_micro_batches)
        return StepCosts(self.step_time, session.world_size, self._usual_micro_batches, cap)

    def state_dict(self) -> dict:
        return {"schedule": self.schedule.state_dict(), "step_time": self.step_time.state_dict()}
