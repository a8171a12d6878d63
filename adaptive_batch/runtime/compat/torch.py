"""torch: the private modules the probe's trials use, and the flags of LRScheduler and DDP AdaptiveBatch touches."""

from __future__ import annotations

import torch

# a dispatch mode that sees every operator, and pytree flattening (probe/trials.py): torch has no public ones
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401
from torch.utils._pytree import tree_flatten  # noqa: F401


def lambda_lr_state(scheduler, leave_out: tuple[str, ...]) -> dict:
    """A `LambdaLR` subclass's `__dict__` without `leave_out` and `LRScheduler`'s private `_get_lr_called*` flags."""
    return {
        key: value
        for key, value in scheduler.__dict__.items()
        if key not in leave_out and not key.startswith("_get_lr_called")
    }


def ddp_forget_forward(model: torch.nn.Module) -> None:
    """Clear DDP's undocumented `require_forward_param_sync`: a forward cut short left it on some ranks only, which
    would make them alone broadcast buffers in the next forward."""
    if hasattr(model, "require_forward_param_sync"):
        model.require_forward_param_sync = False


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module `torch.compile` wrapped (`_orig_mod`: no public accessor), so a check with other shapes compiles
    nothing; the model itself where not compiled."""
    return getattr(model, "_orig_mod", model)


def tensor_version(tensor: torch.Tensor) -> int:
    """The counter of a tensor's in-place changes (`_version`: autograd's, read nowhere public)."""
    return tensor._version
