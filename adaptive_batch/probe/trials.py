"""The probe's trials: one real training step at a given size, its time and peak memory (a GPU's reserved bytes, or
on the CPU a meter of what every op allocates), and the [`Snapshot`] that puts back what the trials change."""

from __future__ import annotations

import contextlib
import math
import random
import tempfile
import time
import weakref
from collections.abc import Iterable

import torch

from ..runtime.compat.torch import TorchDispatchMode, tree_flatten
from ..runtime.memory import Stopwatch, is_out_of_memory, memory_limit, release_memory, synchronize
from .boundary import Trial

# the warm-up's sample: one-time costs do not grow with its length, and it is not a reading
WARM_UP_TOKENS = 64


class TrialRunner:
    """Runs one training step on random token ids at a given size and reads its time and peak memory. A step whose
    memory passes `limit` is stopped there: on a GPU by a forward pre-hook on every module (gradient checkpointing
    runs the forwards again in the backward), on the CPU by the byte meter."""

    def __init__(self, model, optimizer, seq_len, vocab_size, device, autocast_dtype, limit):
        self.model, self.optimizer = model, optimizer
        self.seq_len, self.vocab_size, self.device = seq_len, vocab_size, device
        self.autocast_dtype = autocast_dtype
        self.limit = limit if limit is not None and math.isfinite(limit) else None
        self.generator = torch.Generator().manual_seed(0)
        self.held = self._held()
        self.was_training = model.training

    def warm_up(self) -> Trial:
        """One step on one short sample, for the one-time costs (kernels, allocator, optimizer state): not a reading."""
        trial = self.run(1, seq_len=min(self.seq_len, WARM_UP_TOKENS))
        # the optimizer's state exists from the first step on, and the CPU meter only sees what a step allocates
        self.held = self._held()
        return trial

    def run(
        self, size: int, seq_len: int | None = None, forward_only: bool = False, evaluation: bool = False
    ) -> Trial:
        """One training step on `size` samples, or its forward pass alone; with `evaluation`, an eval step: the forward
        in eval mode without gradients, its logits held as `Trainer.prediction_step` returns them."""
        self.model.train(not evaluation)
        seq_len = seq_len or self.seq_len
        ids = torch.randint(0, self.vocab_size, (size, seq_len), generator=self.generator).to(self.device)
        cpu = self.device.type == "cpu"
        baseline = sum(self.held.values())
        budget = None if self.limit is None else self.limit - baseline
        meter = PeakMeter(budget, self.held.keys()) if cpu else None
        stopwatch = Stopwatch(self.device)
        out_of_memory = stopped = False
        forward_seconds = None
        started = time.perf_counter()
        try:
            with stopwatch, meter if cpu else self._stop_over_limit(), self._autocast():
                with torch.no_grad() if evaluation else contextlib.nullcontext():
                    output = self.model(input_ids=ids, labels=ids)
                    output = output if evaluation else output.loss  # a training step holds its loss alone
                    synchronize(self.device)
                    forward_seconds = time.perf_counter() - started
                if not (evaluation or forward_only):
                    output.backward()
                    self.optimizer.step()
                del output
        except _OverLimit:
            stopped = True
        except Exception as error:  # noqa: BLE001 - only allocation failures are a result, the rest re-raised
            if not is_out_of_memory(error):
                raise
            out_of_memory = True
        self.optimizer.zero_grad(set_to_none=True)
        del ids
        peak, allocated = stopwatch.peak_reserved_bytes, stopwatch.peak_bytes
        if cpu and not out_of_memory:
            peak = allocated = baseline + meter.peak
        elif stopped:  # the stopwatch reads nothing when its block raises
            peak = float(torch.cuda.max_memory_reserved(self.device))
            allocated = float(torch.cuda.max_memory_allocated(self.device))
        until_stopped = time.perf_counter() - started
        # a step cut short leaves tensors in the traceback's reference cycles: collect those
        release_memory(self.device, collect=out_of_memory or stopped)
        seconds = None if out_of_memory or forward_only else until_stopped if stopped else stopwatch.seconds
        forward_seconds = None if out_of_memory or stopped else forward_seconds
        tokens = size * seq_len
        return Trial(
            size, out_of_memory, peak, allocated, seconds, tokens, stopped, forward_seconds, forward_only
        )

    def _held(self) -> dict[int, int]:
        """On the CPU, what the meter does not count: the storages held before a step (none elsewhere)."""
        return held_storages(self.model, self.optimizer) if self.device.type == "cpu" else {}

    @contextlib.contextmanager
    def _stop_over_limit(self):
        if self.limit is None or self.device.type != "cuda":
            yield
            return
        device, limit = self.device, self.limit

        def check(module, args):
            if torch.cuda.memory_reserved(device) > limit:
                raise _OverLimit

        handle = torch.nn.modules.module.register_module_forward_pre_hook(check)
        try:
            yield
        finally:
            handle.remove()

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def close(self) -> None:
        """Put the model's training mode back and let go of the optimizer, so that its state can be freed."""
        self.model.train(self.was_training)
        self.optimizer = None


class _OverLimit(Exception):
    """A trial's memory passed the limit."""


class PeakMeter(TorchDispatchMode):
    """Peak bytes of the tensors that ops create while active (the CPU has no allocator statistics), each storage once
    and those `held` (counted by the caller) left out; raises `_OverLimit` once they pass `budget`."""

    def __init__(self, budget: float | None = None, held: Iterable[int] = ()):
        super().__init__()
        self.budget = budget
        self.held = frozenset(held)
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._track(value)
        if self.budget is not None and self.current > self.budget:
            raise _OverLimit
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self.live or key in self.held:
            return
        self.live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)


def held_storages(model: torch.nn.Module, optimizer) -> dict[int, int]:
    """`{address: bytes}` of the storages held before a step: parameters, buffers, gradients, optimizer state."""
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    storages = (t.untyped_storage() for t in tensors)
    return {storage.data_ptr(): storage.nbytes() for storage in storages if storage.nbytes()}


def trial_limit(device: torch.device, headroom: float, memory_budget: float | None) -> float | None:
    """Bytes a step may use: the device less `headroom` on a GPU (and at most `memory_budget`), the budget on a CPU."""
    device_limit = memory_limit(device, headroom)
    if device_limit is None and memory_budget is None:
        raise ValueError("On the CPU a probe needs memory_budget: the bytes a training step may use.")
    return min(x for x in (device_limit, memory_budget) if x is not None)


def make_optimizer(model: torch.nn.Module, optim: str, learning_rate: float):
    """The optimizer the Trainer would build for `optim`, by the Trainer's own lookup."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=tempfile.gettempdir(),
        optim=optim,
        learning_rate=learning_rate,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
    )
    optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    return optimizer_cls([p for p in model.parameters() if p.requires_grad], **optimizer_kwargs)


def vocab_size(model: torch.nn.Module) -> int:
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if not size:
        raise ValueError(
            "The model's config has no vocab_size, so the probe cannot make token batches for it."
        )
    return int(size)


class Snapshot:
    """Trainable weights, gradients and RNG states before the probe, put back after it."""

    def __init__(self, model: torch.nn.Module):
        self.params = [(p, p.detach().to("cpu", copy=True)) for p in model.parameters() if p.requires_grad]
        self.grads = [(p, p.grad) for p in model.parameters()]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        self.python_rng = random.getstate()

    def restore(self) -> None:
        with torch.no_grad():
            for param, saved in self.params:
                param.copy_(saved.to(param.device))
        for param, grad in self.grads:
            param.grad = grad
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.python_rng)
