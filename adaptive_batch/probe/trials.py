"""Trials for the probe: one real training step at a given size, its time and its peak memory.

Each trial is a forward, a backward and the optimizer the run will use, on a full-length batch of random tokens,
timed with the device synchronised. Its peak memory is read on a GPU from the caching allocator (reserved bytes are
what the limit applies to, allocated bytes are reported too), on the CPU from a dispatch-mode meter of the bytes
every tensor op allocates, against a stated budget. A trial whose memory passes the limit is stopped there.

[`Snapshot`] holds what the trials change (trainable weights, gradients, RNG states) so that the probe can put it
back: the probe leaves no trace.
"""

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
    """Runs one training step at a given size and reads its time and peak memory.

    A step whose memory passes `limit` is stopped there (the rest of it would only confirm that the size does not
    fit): on a GPU a forward pre-hook on every module reads the reserved bytes (with gradient checkpointing the
    backward pass runs the forwards again, so it is watched too), on the CPU the byte meter checks every op.

    Args:
        model: the model to train one step at a time (its training mode is put back by `close`).
        optimizer: the optimizer of the run, over the model's trainable parameters.
        seq_len: tokens per sample of every trial.
        vocab_size: token ids are drawn from `[0, vocab_size)`.
        device: where the model is.
        autocast_dtype: run forward and backward under `torch.autocast` with this dtype, or `None`.
        limit: bytes a step may use (`None` or infinite: no limit).
    """

    def __init__(self, model, optimizer, seq_len, vocab_size, device, autocast_dtype, limit):
        self.model, self.optimizer = model, optimizer
        self.seq_len, self.vocab_size, self.device = seq_len, vocab_size, device
        self.autocast_dtype = autocast_dtype
        self.limit = limit if limit is not None and math.isfinite(limit) else None
        self.generator = torch.Generator().manual_seed(0)
        self.held = self._held()
        self.was_training = model.training

    def warm_up(self) -> Trial:
        """One step on one short sample, for the one-time costs (kernels, allocator, the optimizer's state, lazy
        initialisation): their time and memory are not readings. Its time is the trial's `seconds`."""
        trial = self.run(1, seq_len=min(self.seq_len, WARM_UP_TOKENS))
        # the optimizer's state exists from the first step on, and the CPU meter only sees what a step allocates
        self.held = self._held()
        return trial

    def run(
        self, size: int, seq_len: int | None = None, forward_only: bool = False, evaluation: bool = False
    ) -> Trial:
        """One training step on `size` samples of `seq_len` tokens (default: the runner's), or its forward pass
        alone. The forward's time is read too (the device synchronised when the loss is computed). With
        `evaluation`, an eval step instead: the model in eval mode, the forward without gradients, its logits held
        as `Trainer.prediction_step` returns them (the optimizer's state stays, as in an evaluation during
        training); its `seconds` is that forward's time."""
        model = self.model
        model.train(not evaluation)
        seq_len = seq_len or self.seq_len
        ids = torch.randint(0, self.vocab_size, (size, seq_len), generator=self.generator).to(self.device)
        cpu = self.device.type == "cpu"
        baseline = sum(self.held.values())
        meter = (
            PeakMeter(None if self.limit is None else self.limit - baseline, self.held.keys())
            if cpu
            else None
        )
        stopwatch = Stopwatch(self.device)
        out_of_memory = stopped = False
        forward_seconds = None
        started = time.perf_counter()
        try:
            with stopwatch, meter if cpu else self._stop_over_limit(), self._autocast():
                if evaluation:
                    with torch.no_grad():
                        output = model(input_ids=ids, labels=ids)
                        synchronize(self.device)
                        forward_seconds = time.perf_counter() - started
                    del output
                else:
                    loss = model(input_ids=ids, labels=ids).loss
                    synchronize(self.device)
                    forward_seconds = time.perf_counter() - started
                    if not forward_only:
                        loss.backward()
                        self.optimizer.step()
                    del loss
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
        if out_of_memory or stopped:
            forward_seconds = None
        seconds = None if out_of_memory or forward_only else until_stopped if stopped else stopwatch.seconds
        return Trial(
            size,
            out_of_memory,
            peak,
            allocated,
            seconds,
            size * seq_len,
            stopped,
            forward_seconds,
            forward_only,
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
    """Peak bytes of the tensors that ops create while active (CPU has no allocator statistics); raises
    `_OverLimit` once they pass `budget`.

    Ops also return tensors that existed before (a view of a weight, an optimizer state updated in place): the
    storages in `held` are counted by the caller already and are left out, and any other one once.
    """

    def __init__(self, budget: float | None = None, held: Iterable[int] = ()):
        super().__init__()
        self.budget = budget
        self.held = frozenset(held)
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

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
    """`{address: bytes}` of the storages held before a step: parameters, buffers, gradients, optimizer state (a
    storage shared by several tensors, such as tied weights, once)."""
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
    """The optimizer the Trainer would build for `optim` (bitsandbytes' paged 8-bit AdamW included).

    The Trainer's own lookup takes a `TrainingArguments`; building one costs well under a millisecond (measured on
    the CPU), so the class and its keyword arguments come from the Trainer itself rather than a copy of its table.
    The first call imports `transformers.Trainer`, which a training script has imported anyway.
    """
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
    """The number of token ids the model's embedding takes, from its config."""
    config = getattr(model, "config", None)
    size = getattr(config, "vocab_size", None)
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
