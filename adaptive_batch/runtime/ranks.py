"""The rank-agreement protocol: after each micro-batch (or eval piece), and before each collective inside one, the
ranks exchange a [`Report`]. See docs/how-it-works.md, "Several processes"."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import astuple, dataclass

import torch
import torch.distributed as dist

from ..core.replay import Tape
from .compat.accelerate import before_collectives
from .memory import is_out_of_memory


@dataclass
class Report:
    """What the ranks exchange, combined by MAX: an out-of-memory error, a timed micro-batch's measurements (peak
    -inf where not measured), and the size of the smallest that failed (sent negated, so that MAX gives it)."""

    out_of_memory: bool = False
    seconds: float = 0.0
    peak_bytes: float = -math.inf
    real_tokens: float = 0.0
    padded_tokens: float = 0.0
    failed_rows: int | None = None
    failed_tokens: int | None = None

    def to_list(self) -> list[float]:
        *values, rows, tokens = astuple(self)
        failed = [-math.inf if n is None else -float(n) for n in (rows, tokens)]
        return [float(value) for value in values] + failed

    @classmethod
    def from_list(cls, values: list[float]) -> Report:
        failed = (None if value == -math.inf else int(-value) for value in values[5:])
        return cls(bool(values[0]), *values[1:5], *failed)

    @property
    def measured_peak(self) -> float | None:
        return None if self.peak_bytes == -math.inf else self.peak_bytes


class PeerOutOfMemory(Exception):
    """Another rank ran out of memory; raised on the others at the collective they wait in."""

    def __init__(self, report: Report):
        super().__init__("another rank ran out of memory")
        self.report = report


class Ranks:
    """The processes that train (or evaluate) together, and the exchanges between them (in one process, no-ops)."""

    def __init__(self, trainer, world_size: int):
        self.trainer, self.world_size = trainer, world_size
        self.device: torch.device = trainer.args.device

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    @property
    def count(self) -> int:
        """The processes whose gradients are averaged."""
        return self.world_size if self.distributed else 1

    def max(self, values: list[float]) -> list[float]:
        return self._all_reduce(values, dist.ReduceOp.MAX)

    def sum(self, values: list[float]) -> list[float]:
        return self._all_reduce(values, dist.ReduceOp.SUM)

    def exchange(self, report: Report) -> Report:
        return Report.from_list(self.max(report.to_list())) if self.distributed else report

    def run(
        self,
        work: Callable[[], Report],
        failed: Callable[[], Report],
        tape: Tape,
        key: tuple[str, int, str],
        fatal: Callable[[BaseException], Exception] | None = None,
    ) -> Report:
        """Run `work` on every rank; returns the report they agree on (`failed()` where this rank ran out of memory,
        or the replayed run did at `key`). `fatal`: the error to raise instead of retrying."""
        if tape.recorded_failure(*key):
            return self.exchange(failed())
        try:
            with self._guard():
                local = work()
        except PeerOutOfMemory as peer:  # the reports were exchanged where this rank waited
            return peer.report
        except Exception as error:  # noqa: BLE001 - only allocation failures are handled, the rest re-raised
            if not is_out_of_memory(error):
                raise
            if fatal is not None:
                raise fatal(error) from error
            tape.failure(*key)
            local = failed()
        return self.exchange(local)

    def _guard(self):
        """An exchange before each collective of the Trainer or TRL: where a rank failed, every rank stops there."""
        if not self.distributed:
            return contextlib.nullcontext()

        def check() -> None:
            report = self.exchange(Report())
            if report.out_of_memory:
                raise PeerOutOfMemory(report)

        return before_collectives(self.trainer.accelerator, check)

    def _all_reduce(self, values: list[float], op) -> list[float]:
        if not self.distributed:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=op)
        return tensor.tolist()
