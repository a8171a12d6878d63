"""Device memory: recognise an out-of-memory error, free what it left behind, measure peaks and time."""

from __future__ import annotations

import gc
import time

import torch

# Messages of allocation failures that are not raised as `torch.OutOfMemoryError`:
OOM_MESSAGES = (
    "CUDA out of memory",  # older torch raised a plain RuntimeError
    "CUDA error: out of memory",  # a kernel's own allocation
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS workspace
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED",  # cuDNN reports a failed workspace allocation this way
    "DefaultCPUAllocator: can't allocate memory",  # the CPU allocator
    "XPU out of memory",
    "MPS backend out of memory",
)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation failure that a smaller micro-batch may avoid."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(message in str(error) for message in OOM_MESSAGES)


def release_memory(device: torch.device, collect: bool = True) -> None:
    """Return cached blocks to the device, after collecting the garbage a failed step leaves (`collect`)."""
    if collect:
        gc.collect()
    if device.type in ("cuda", "xpu", "mps"):
        getattr(torch, device.type).empty_cache()


def synchronize(device: torch.device) -> None:
    if device.type in ("cuda", "xpu"):
        getattr(torch, device.type).synchronize(device)


class Stopwatch:
    """Wall time and peak allocated (and reserved) memory of a block, synchronised at both ends (none on error)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds = 0.0
        self.peak_bytes: float | None = None
        self.peak_reserved_bytes: float | None = None

    def __enter__(self) -> Stopwatch:
        synchronize(self.device)
        reset_peak(self.device)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:
            return
        synchronize(self.device)
        self.seconds = time.perf_counter() - self._start
        if self.device.type == "cuda":
            self.peak_bytes = float(torch.cuda.max_memory_allocated(self.device))
            self.peak_reserved_bytes = float(torch.cuda.max_memory_reserved(self.device))


def memory_limit(device: torch.device, headroom: float) -> float | None:
    """Bytes a micro-batch's peak may use on `device`, leaving `headroom` of the whole device free; `None` on CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory * (1.0 - headroom)


def alloc_retries(device: torch.device) -> int:
    """The caching allocator's `num_alloc_retries` (it rises when memory is nearly full); 0 off CUDA."""
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)) if device.type == "cuda" else 0


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_allocated(device: torch.device) -> float | None:
    return float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
