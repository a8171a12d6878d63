"""Each micro-batch's contribution to the step gradient, for the noise scale, read by a hook on each parameter. See
docs/how-it-works.md, "Data, cuts and measurements" (Gradient noise scale)."""

from __future__ import annotations

import math
import warnings

import torch

from ..core.noise import MicroBatchSums

SPLIT = (
    "a parameter received its gradient in several parts within one micro-batch (a weight shared by layers "
    "under reentrant gradient checkpointing, or two backward passes per micro-batch), and the norm of a sum is "
    "not the sum of its parts' norms"
)


class GradientNoiseMeter:
    """Squared norms of every micro-batch's contribution to the step gradient, and of the step gradient."""

    def __init__(self, preconditioner: str = "none", device: torch.device | str = "cpu"):
        self.preconditioner = preconditioner
        self.device = torch.device(device)
        self.params: list[torch.nn.Parameter] = []
        self.handles: list = []
        self.denominators: list[tuple[torch.Tensor, float, float]] | None = None
        self.warned: set[str] = set()
        self.available = True  # False while the preconditioner's state is missing
        self.begin_attempt()

    def begin_step(self, model: torch.nn.Module, optimizer=None) -> None:
        """Hooks on the trainable parameters (at the first step); Adam's denominators for this step."""
        if not self.handles:
            self.params = [p for p in model.parameters() if p.requires_grad]
            self.handles = [p.register_hook(self._hook(index)) for index, p in enumerate(self.params)]
        self.available = True
        if self.preconditioner == "adam":
            self.denominators = self._adam_denominators(optimizer)
            self.available = self.denominators is not None

    def begin_attempt(self) -> None:
        """Forget what an attempt that ran out of memory measured."""
        self.measuring = False
        self.norms: list[torch.Tensor] = []  # the current micro-batch's, one per hook call
        self.seen: set[int] = set()
        self.split = False
        self.micro_batches: list[tuple[float, float, torch.Tensor]] = []  # (units, share, |d_j|^2)
        # the first micro-batch is read from `.grad` (empty at the step's start) when the next one begins
        self.first: tuple[float, float] | None = None
        self.grads_empty = all(p.grad is None for p in self.params)

    def begin_micro_batch(self, units: float, share: float) -> None:
        """Before a micro-batch of `units` (label tokens or rows) weighing `share` in the step gradient."""
        if not self.available:
            return
        if self.grads_empty and self.first is None and not self.micro_batches:
            self.first = (units, share)
            return
        self._read_first()
        self.norms, self.seen, self.measuring = [], set(), True
        self.micro_batches.append((units, share, torch.zeros((), device=self.device)))

    def end_micro_batch(self) -> None:
        if not self.measuring:
            return
        self.measuring = False
        if self.norms:
            units, share, _ = self.micro_batches[-1]
            self.micro_batches[-1] = (units, share, _sum_of_squares(self.norms, self.device))
        self.norms = []

    def step_sums(self, world_size: int, every_rank: bool) -> MicroBatchSums:
        """This rank's sums for the step, each d_j divided by `world_size`, before the ranks' average."""
        if self.split:
            self.warn_once("split", f"The gradient noise scale is not measured in such steps: {SPLIT}.")
        if self.split or not self.available:  # (Adam's state comes with the first optimizer step: no warning)
            return MicroBatchSums(shares=math.nan)  # a NaN survives the ranks' sum: every rank skips the step
        if not every_rank and len(self.micro_batches) + (self.first is not None) < 2:
            return MicroBatchSums()
        self._read_first()
        sums = MicroBatchSums()
        if not self.micro_batches:
            return sums
        norms_sq = torch.stack([norm_sq for _, _, norm_sq in self.micro_batches]).tolist()
        for (units, share, _), norm_sq in zip(self.micro_batches, norms_sq):
            sums.add(units, share, norm_sq / world_size**2)
        return sums

    def step_norm_sq(self) -> float:
        """S_big, |G_step|^2 of the parameters' `.grad` (after the ranks' average, before clipping)."""
        return self._grad_norm_sq().item()

    def _grad_norm_sq(self) -> torch.Tensor:
        norms = [self._norm(index, p.grad) for index, p in enumerate(self.params) if p.grad is not None]
        return _sum_of_squares(norms, self.device) if norms else torch.zeros((), device=self.device)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.params, self.denominators = [], [], None

    def warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(message, stacklevel=2)

    def _hook(self, index: int):
        def hook(grad: torch.Tensor) -> None:
            if not self.measuring:
                return
            if index in self.seen:
                self.split = True
            self.seen.add(index)
            self.norms.append(self._norm(index, grad))

        return hook

    def _norm(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        """The norm of a gradient in fp32 at least (divided by Adam's denominator under that preconditioner)."""
        dtype = torch.promote_types(grad.dtype, torch.float32)
        if self.denominators is not None:
            exp_avg_sq, correction, eps = self.denominators[index]
            # out of place: `grad` may be `.grad` itself
            grad = grad.to(dtype) / (exp_avg_sq.sqrt() / correction + eps)
        return torch.linalg.vector_norm(grad, dtype=dtype)

    def _read_first(self) -> None:
        if self.first is None:  # the first micro-batch's |d_1|^2, from `.grad` (empty before it)
            return
        units, share = self.first
        self.first = None
        self.micro_batches.insert(0, (units, share, self._grad_norm_sq()))

    def _adam_denominators(self, optimizer) -> list[tuple[torch.Tensor, float, float]] | None:
        """(exp_avg_sq, sqrt(1 - beta2^t), eps) for every parameter, or `None` until the optimizer holds them."""
        if optimizer is None:
            return None
        groups = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        denominators = []
        for p in self.params:
            state, group = optimizer.state.get(p, {}), groups.get(id(p))
            exp_avg_sq = state.get("exp_avg_sq")
            if not isinstance(exp_avg_sq, torch.Tensor) or exp_avg_sq.shape != p.shape or group is None:
                if state:  # a state of another kind (e.g. 8-bit), not one that is still to come
                    self.warn_once(
                        "adam state",
                        "noise_preconditioner='adam' reads the optimizer's 'exp_avg_sq' (torch's Adam and AdamW), "
                        f"which {type(optimizer).__name__} does not hold, so the noise scale is not measured. Use "
                        "noise_preconditioner='none' (raw gradients) with this optimizer.",
                    )
                return None
            step = float(state.get("step", 0))
            beta2 = group["betas"][1]
            correction = math.sqrt(1.0 - beta2**step) if step > 0 else 1.0
            denominators.append((exp_avg_sq, correction, float(group["eps"])))
        return denominators


def _sum_of_squares(norms: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    dtype = torch.float64 if any(norm.dtype == torch.float64 for norm in norms) else torch.float32
    return torch.stack([norm.to(device, dtype) for norm in norms]).square().sum()
