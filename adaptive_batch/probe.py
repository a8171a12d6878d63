"""`probe`: the largest micro-batch that fits a model and setup, and the fastest one, before a run.

Each trial is a real training step on a full-length batch (forward, backward, the optimizer the run will use),
timed with the device synchronised and its peak memory read: on a GPU from the caching allocator (reserved bytes
are what the limit applies to, allocated bytes are reported too), on the CPU from a dispatch-mode meter of the
bytes every tensor op allocates, against a stated budget. Memory is released between trials, and the model's
trainable weights and the RNG states are put back as they were afterwards: the probe leaves no trace.

The search ([`boundary.find_boundary`]) needs about five trials when memory grows affinely with the batch; the
recommendation is the smallest size within 2% of the best measured tokens/s.

Example:
    ```python
    report = probe(model, seq_len=1024, optim="paged_adamw_8bit", effective_batch_size=64)
    report.boundary, report.recommended, report.per_device_train_batch_size, report.gradient_accumulation_steps
    ```
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .boundary import Trial, find_boundary, next_throughput_size, recommend, split_effective_batch
from .memory import Stopwatch, is_out_of_memory, memory_limit, release_memory

CACHE_ENV = "ADAPTIVE_BATCH_CACHE"
THROUGHPUT_TRIALS = 3  # trials after the search, to find the smallest size near the best speed


@dataclass
class ProbeReport:
    """What a probe found. Sizes are samples per micro-batch on one device; tokens are `size x seq_len`."""

    setup: dict
    seq_len: int
    limit_bytes: float | None
    trials: list[dict]
    boundary: int
    first_failing: int | None
    predicted: int | None
    recommended: int
    recommended_by: str
    boundary_tokens: int
    per_device_train_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    effective_batch_size: int | None = None
    gpus: int = 1
    seconds: float = 0.0
    warm_up_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def probe(
    model: torch.nn.Module,
    seq_len: int,
    optim: str = "adamw_torch",
    learning_rate: float = 2e-4,
    device: torch.device | str | None = None,
    headroom: float = 0.05,
    memory_budget: float | None = None,
    max_size: int = 4096,
    largest: bool = False,
    effective_batch_size: int | None = None,
    gpus: int = 1,
    autocast_dtype: torch.dtype | None = None,
    setup: dict | None = None,
    on_trial: Callable[[Trial], None] | None = None,
) -> ProbeReport:
    """Find the boundary and a recommended micro-batch for `model` on sequences of `seq_len` tokens.

    Args:
        model: the model as the run will train it (quantised, with adapters, checkpointing enabled).
        seq_len: tokens per sample; every trial batch is full length.
        optim: a `TrainingArguments.optim` name; the probe builds that optimizer as the Trainer would.
        device: where the model is; default: the device of its first parameter.
        headroom: on a GPU, the share of device memory to keep free (the limit is `(1 - headroom) x total`).
        memory_budget: on the CPU, the bytes a step may use (required there).
        max_size: the largest size to consider.
        largest: recommend the boundary instead of the fastest size.
        effective_batch_size, gpus: also give the `per_device x accumulation` pair for this effective batch.
        autocast_dtype: run forward and backward under `torch.autocast` with this dtype (as `bf16=True` does).
        setup: what identifies the setup (for the report and the cache).
        on_trial: called after every trial (for a progress bar).
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    limit = _limit(device, headroom, memory_budget)
    started = time.perf_counter()
    snapshot = _Snapshot(model)
    optimizer = _make_optimizer(model, optim, learning_rate)
    vocab_size = _vocab_size(model)
    runner = _TrialRunner(model, optimizer, seq_len, vocab_size, device, autocast_dtype, limit)
    try:
        # kernels, allocator, optimizer state, lazy initialisation: its time and memory are not readings
        warm_up = runner.run(1)
        trials: list[Trial] = []

        def run(size: int) -> Trial:
            trial = runner.run(size)
            trials.append(trial)
            if on_trial is not None:
                on_trial(trial)
            return trial

        search = find_boundary(run, limit, max_size=max_size)
        if not largest:
            for _ in range(THROUGHPUT_TRIALS):
                size = next_throughput_size(trials, limit)
                if size is None:
                    break
                run(size)
    finally:
        del optimizer
        runner.close()
        snapshot.restore()
        release_memory(device)
    recommended = recommend(trials, limit, largest=largest)
    report = ProbeReport(
        setup=setup or {},
        seq_len=seq_len,
        limit_bytes=limit,
        trials=[{**t.to_dict(), "fits": t.fits(limit)} for t in sorted(trials, key=lambda t: t.size)],
        boundary=search.boundary,
        first_failing=search.first_failing,
        predicted=search.predicted,
        recommended=recommended,
        recommended_by="largest that fits" if largest else "smallest within 2% of the best tokens/s",
        boundary_tokens=search.boundary * seq_len,
        gpus=gpus,
        seconds=time.perf_counter() - started,
        warm_up_seconds=warm_up.seconds or 0.0,
    )
    if effective_batch_size is not None:
        report.effective_batch_size = effective_batch_size
        report.per_device_train_batch_size, report.gradient_accumulation_steps = split_effective_batch(
            recommended, effective_batch_size, gpus
        )
    return report


# -- trials ------------------------------------------------------------------------------------------------------


class _TrialRunner:
    """Runs one training step at a given size and reads its time and peak memory.

    A step whose memory passes `limit` is stopped there (the rest of it would only confirm that the size does not
    fit): on a GPU a forward pre-hook on every module reads the reserved bytes (with gradient checkpointing the
    backward pass runs the forwards again, so it is watched too), on the CPU the byte meter checks every op.
    """

    def __init__(self, model, optimizer, seq_len, vocab_size, device, autocast_dtype, limit):
        self.model, self.optimizer = model, optimizer
        self.seq_len, self.vocab_size, self.device = seq_len, vocab_size, device
        self.autocast_dtype = autocast_dtype
        self.limit = limit if limit is not None and math.isfinite(limit) else None
        self.generator = torch.Generator().manual_seed(0)
        self.baseline = _live_bytes(model, optimizer) if device.type == "cpu" else 0.0
        self.was_training = model.training

    def run(self, size: int) -> Trial:
        model = self.model
        model.train()
        ids = torch.randint(0, self.vocab_size, (size, self.seq_len), generator=self.generator).to(
            self.device
        )
        cpu = self.device.type == "cpu"
        meter = _PeakMeter(None if self.limit is None else self.limit - self.baseline) if cpu else None
        stopwatch = Stopwatch(self.device)
        out_of_memory = stopped = False
        started = time.perf_counter()
        try:
            with stopwatch, meter if cpu else self._stop_over_limit(), self._autocast():
                loss = model(input_ids=ids, labels=ids).loss
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
            peak = allocated = self.baseline + meter.peak
        elif stopped:  # the stopwatch reads nothing when its block raises
            peak = float(torch.cuda.max_memory_reserved(self.device))
            allocated = float(torch.cuda.max_memory_allocated(self.device))
        until_stopped = time.perf_counter() - started
        # a step cut short leaves tensors in the traceback's reference cycles: collect those
        release_memory(self.device, collect=out_of_memory or stopped)
        seconds = None if out_of_memory else until_stopped if stopped else stopwatch.seconds
        return Trial(size, out_of_memory, peak, allocated, seconds, size * self.seq_len, stopped)

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
        self.model.train(self.was_training)


class _OverLimit(Exception):
    """A trial's memory passed the limit."""


class _PeakMeter(TorchDispatchMode):
    """Peak bytes of the tensors that ops create while active (CPU has no allocator statistics); raises
    `_OverLimit` once they pass `budget`."""

    def __init__(self, budget: float | None = None):
        super().__init__()
        self.budget = budget
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
        if size == 0 or key in self.live:
            return
        self.live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)


def _live_bytes(model: torch.nn.Module, optimizer) -> float:
    """Bytes held before a step: parameters, buffers, gradients and optimizer state."""
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return float(sum(t.numel() * t.element_size() for t in tensors))


def _limit(device: torch.device, headroom: float, memory_budget: float | None) -> float | None:
    """Bytes a step may use: the device less `headroom` on a GPU (and at most `memory_budget`), the budget on a CPU."""
    device_limit = memory_limit(device, headroom)
    if device_limit is None and memory_budget is None:
        raise ValueError("On the CPU a probe needs memory_budget: the bytes a training step may use.")
    return min(x for x in (device_limit, memory_budget) if x is not None)


def _make_optimizer(model: torch.nn.Module, optim: str, learning_rate: float):
    """The optimizer the Trainer would build for `optim` (bitsandbytes' paged 8-bit AdamW included)."""
    import tempfile

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


def _vocab_size(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    size = getattr(config, "vocab_size", None)
    if not size:
        raise ValueError(
            "The model's config has no vocab_size, so the probe cannot make token batches for it."
        )
    return int(size)


class _Snapshot:
    """Trainable weights and RNG states before the probe, put back after it."""

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


# -- the cache ---------------------------------------------------------------------------------------------------


def default_optim() -> str:
    """The optimizer a TrainingArguments builds when `optim` is not given (it changes between releases)."""
    from transformers import TrainingArguments

    default = TrainingArguments.__dataclass_fields__["optim"].default
    return str(getattr(default, "value", default))


def setup_key(setup: dict) -> str:
    """A stable key of everything that changes memory (the setup without the sequence length)."""
    text = json.dumps({k: v for k, v in setup.items() if k != "seq_len"}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "adaptive-batch" / "probe")


def save_report(report: ProbeReport) -> Path:
    """Store the report under its setup key, one entry per sequence length."""
    path = cache_dir() / f"{setup_key(report.setup)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = json.loads(path.read_text()) if path.exists() else {}
    entries[str(report.seq_len)] = report.to_dict()
    path.write_text(json.dumps(entries, indent=1, default=str))
    return path


def cached_micro_batch_size(setup: dict, seq_len: int) -> tuple[int, int] | None:
    """`(recommended size, probed seq_len)` of the entry with the shortest probed length >= `seq_len`, if any."""
    path = cache_dir() / f"{setup_key(setup)}.json"
    if not path.exists():
        return None
    entries = json.loads(path.read_text())
    lengths = sorted(int(length) for length in entries if int(length) >= seq_len)
    if not lengths:
        return None
    return int(entries[str(lengths[0])]["recommended"]), lengths[0]


def describe_setup(model: torch.nn.Module, optim: str, gradient_checkpointing: bool) -> dict:
    """What changes memory, read off a live model: the same dict whether it comes from the CLI or a Trainer."""
    import transformers

    optim = getattr(optim, "value", optim)  # TrainingArguments holds an OptimizerNames member
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.to_dict()
    quantization = config.pop("quantization_config", None)
    for key in (
        "_name_or_path",
        "transformers_version",
        "architectures",
        "torch_dtype",
        "dtype",
        "use_cache",
    ):
        config.pop(key, None)
    peft_config = getattr(model, "peft_config", {}).get("default") if hasattr(model, "peft_config") else None
    lora = None
    if peft_config is not None:
        targets = peft_config.target_modules
        lora = {
            "r": peft_config.r,
            "alpha": peft_config.lora_alpha,
            "targets": sorted(targets) if isinstance(targets, (set, list, tuple)) else targets,
        }
    dtype = str(next(p for p in base.parameters() if p.dtype.is_floating_point).dtype)
    device = next(model.parameters()).device
    return {
        "model": config,
        "dtype": dtype,
        "quantization": {k: str(v) for k, v in quantization.items()}
        if isinstance(quantization, dict)
        else None,
        "lora": lora,
        "gradient_checkpointing": bool(gradient_checkpointing),
        "optim": optim,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def load_model(
    model_dir: str,
    dtype: torch.dtype,
    load_in_4bit: bool,
    lora_r: int | None,
    lora_alpha: int | None,
    lora_targets: list[str] | None,
    gradient_checkpointing: bool,
    seq_len: int,
    device: torch.device,
):
    """Load a causal LM the way a QLoRA run would, checking the inputs first (one clear error each)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(
            f"model directory {model_dir} does not exist; pass a folder written by save_pretrained."
        )
    config = AutoConfig.from_pretrained(path)
    longest = getattr(config, "max_position_embeddings", None)
    if longest and seq_len > longest:
        raise ValueError(
            f"--seq-len {seq_len} exceeds the model's max_position_embeddings={longest}; use --seq-len {longest} "
            "or less."
        )
    if lora_r:
        _check_lora_targets(config, lora_targets or [])
    kwargs = {"dtype": dtype}
    if load_in_4bit:
        from transformers import BitsAndBytesConfig

        if device.type == "cpu":
            kwargs["device_map"] = {"": "cpu"}
        else:
            kwargs["device_map"] = {"": device.index or 0}
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype if dtype != torch.float32 else torch.float32,
        )
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if not load_in_4bit:
        model.to(device)
    model.config.use_cache = False
    if load_in_4bit:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=lora_r,
                lora_alpha=lora_alpha or 2 * lora_r,
                target_modules=lora_targets,
                task_type="CAUSAL_LM",
            ),
        )
    return model


def _check_lora_targets(config, targets: list[str]) -> None:
    """Raise if a LoRA target names no module, looking at a weightless (meta-device) copy of the model."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = {name.rsplit(".", 1)[-1] for name, _ in skeleton.named_modules()}
    missing = [t for t in targets if t not in names and t != "all-linear"]
    if missing:
        linear = sorted(
            {n.rsplit(".", 1)[-1] for n, m in skeleton.named_modules() if isinstance(m, torch.nn.Linear)}
        )
        raise ValueError(
            f"--lora-target {','.join(missing)} matches no module of this model; its linear layers are "
            f"{', '.join(linear)}."
        )


def format_gib(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value / 2**30:.2f}" if value < 10 * 2**30 else f"{value / 2**30:.1f}"
