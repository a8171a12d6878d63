"""What the tests share besides fixtures: the settings of a test run, comparisons of runs and their logs, Trainers
that record their micro-batches, and a model whose gradient noise is known in closed form.

A plain module, imported by name (`from helpers import ORDER_ONLY`): by the test files, by conftest.py's fixtures
and by ddp_worker.py, which launch.py runs as a script (tests/ is on sys.path in all three). Test files import no
other test file and not conftest (tests/test_suite_layout.py checks it); launching processes is in launch.py."""

from __future__ import annotations

import os

import torch
from transformers import Trainer

# the environment of every test run, and of the processes the tests launch (they inherit it; a worker run alone,
# as benchmarks/engine_resets.py runs it, gets it by importing this module)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# under `pytest -n 2`, one torch thread per worker: as many threads as cores in all
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


# -- comparing runs --------------------------------------------------------------------------------------------------
#
# A run that should equal another one exactly (an out-of-memory retry against a run at the final size, a resume
# against the uninterrupted run) is compared bit for bit: `assert_same_parameters`.
#
# Runs that differ in the order of floating-point additions (a step cut into other micro-batches, two ranks against
# one process) are compared with ORDER_ONLY settings: float64, and SGD, whose update is linear in the gradient, so
# the rounding differences (about 1e-16 relative) stay that small on any machine. Adam would divide them by the root
# of tiny second moments (1e-8 was seen on another machine). One sample swapped for another moves the weights by far
# more than ORDER_TOLERANCE (test_equivalence.py::test_the_tolerance_is_far_below_what_one_sample_changes).
# transformers' causal-LM loss rounds the logits to float32 (`logits.float()`), which would turn float64 rounding
# differences into float32 ones now and then: a float64 model gets a float64 loss (`keep_loss_in_float64`).
ORDER_ONLY = dict(dtype=torch.float64, optim="sgd", learning_rate=0.1)
ORDER_TOLERANCE = 1e-10


def float64_causal_lm_loss(
    logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs
):
    """transformers' `ForCausalLMLoss` without its cast to float32."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.reshape(-1).to(logits.device)
    total = torch.nn.functional.cross_entropy(
        logits.reshape(-1, vocab_size), shift_labels, ignore_index=ignore_index, reduction="sum"
    )
    count = num_items_in_batch if num_items_in_batch is not None else (shift_labels != ignore_index).sum()
    return total / count


def keep_loss_in_float64(model):
    """Give a float64 causal LM a float64 loss (see ORDER_ONLY)."""
    model._loss_function = float64_causal_lm_loss
    return model


# TrainingArguments of every test run: on the CPU, seeded, a log line per step, nothing saved or reported
QUIET_CPU_RUN = dict(
    logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True
)


def parameters(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_close_parameters(a: dict, b: dict, rtol: float = ORDER_TOLERANCE):
    assert a.keys() == b.keys()
    for name in a:
        diff = (a[name] - b[name]).norm() / b[name].norm().clamp_min(1e-12)
        assert diff < rtol, f"{name}: relative difference {diff:.2e}"


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module):
    """Bit for bit."""
    pairs = list(zip(a.named_parameters(), b.named_parameters(), strict=True))
    for (name, x), (_, y) in pairs:
        assert torch.equal(x, y), f"{name}: differs by up to {(x - y).abs().max():.2e}"


def step_logs(trainer) -> list[dict]:
    """The training logs of every optimizer step (logging_steps=1)."""
    return [log for log in trainer.state.log_history if "loss" in log]


def adaptive_of(trainer):
    """The `AdaptiveBatch` among a Trainer's callbacks (its plan, `current()` and `state()` are public)."""
    from adaptive_batch import AdaptiveBatch

    (adaptive,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, AdaptiveBatch)]
    return adaptive


def eval_pieces(trainer):
    """The [`runtime.evaluation.EvalPieces`] running `trainer`'s eval batches (`None`: the Trainer's own)."""
    return trainer._adaptive_batch.assembly.eval_pieces


def saved_state(trainer) -> dict:
    """What AdaptiveBatch writes into the Trainer's checkpoints now (`ExportableState.state()`)."""
    return adaptive_of(trainer).state()["attributes"]["checkpoint"]


def logged(trainer, key: str) -> list:
    return [log[key] for log in step_logs(trainer)]


def logged_or_none(trainer, key: str) -> list:
    """`logged` for a key some logs leave out (the noise keys, on steps that measured nothing): `None` there."""
    return [log.get(key) for log in step_logs(trainer)]


def sequences(inputs: dict) -> list[tuple[int, ...]]:
    """The token ids of every row of a collated batch without padding, or of every sequence of a flattened one (in
    one row, or packed into several rows, each row's unused tail left out)."""
    ids, mask = inputs["input_ids"], inputs.get("attention_mask")
    if mask is not None:
        return [tuple(r[m.bool()].tolist()) for r, m in zip(ids, mask)]
    found, labels, width = [], inputs.get("labels"), ids.shape[1]
    for row, positions in enumerate(inputs["position_ids"].expand(ids.shape)):
        breaks = ((positions[1:] - positions[:-1] != 1).nonzero().flatten() + 1).tolist()
        starts = [0, *breaks, width]
        for a, b in zip(starts, starts[1:]):
            unlabelled = labels is None or bool((labels[row, a:b] == -100).all())
            tail = b == width and unlabelled and not ids[row, a:b].any()  # a packed row's unused tail
            if not tail:
                found.append(tuple(ids[row, a:b].tolist()))
    return found


class RecordingMixin:
    """Records every micro-batch its `training_step` gets, as `(optimizer step, rows, padded length, label tokens,
    the rows' tokens without padding)`, in `micro_batches` (one list per instance). A flattened (padding-free) batch
    is one row; its "rows' tokens" are its sequences'. Put it in front of a Trainer class."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        rows, length = inputs["input_ids"].shape
        labels = int((inputs["labels"] != -100).sum())
        content = sequences(inputs)
        self.__dict__.setdefault("micro_batches", []).append(
            (self.state.global_step, rows, length, labels, content)
        )
        return super().training_step(model, inputs, num_items_in_batch)


class MeanLossModel(torch.nn.Module):
    """A model whose loss is its own mean over label tokens, so no `num_items_in_batch` reaches it.

    With `shift`, position i predicts label i + 1, as causal LMs do; without, every labelled position is scored.
    """

    def __init__(self, inner, shift: bool = True):
        super().__init__()
        self.inner = inner
        self.shift = shift

    def get_input_embeddings(self):  # (what the checks on a model read its vocabulary from)
        return self.inner.get_input_embeddings()

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.inner(input_ids=input_ids, attention_mask=attention_mask).logits
        scored, targets = (logits[:, :-1], labels[:, 1:]) if self.shift else (logits, labels)
        loss = torch.nn.functional.cross_entropy(scored.flatten(0, 1), targets.flatten(), ignore_index=-100)
        return {"loss": loss, "logits": logits}


def first_step_batch(trainer) -> dict:
    """The first step batch of a Trainer with AdaptiveBatch: its data loader yields each step in the last of the
    loop's `gradient_accumulation_steps` slots, the others empty (`None`)."""
    return next(batch for batch in trainer.get_train_dataloader() if batch is not None)


class Recording(RecordingMixin, Trainer):
    """A `transformers.Trainer` that records its micro-batches (see `RecordingMixin`)."""


# -- a model whose gradient noise is known in closed form ----------------------------------------------------------


class LinearRegression(torch.nn.Module):
    """Predicts y = w . x with the loss 1/2 (w . x - y)^2, averaged over the rows (a mean loss: no
    `num_items_in_batch`).

    On rows from `RegressionRows` (x ~ N(0, I_d), y = w* . x + eps, eps ~ N(0, s^2)) and at fixed weights w (learning
    rate 0), a sample's gradient is (r . x - eps) x with r = w - w*, so (`regression_truth`):
    - G = E[(r . x) x] = r, |G|^2 = |r|^2;
    - E|g|^2 = E[(r . x)^2 |x|^2] + s^2 E|x|^2 = (d + 2)|r|^2 + d s^2 (Gaussian fourth moments:
      E[(r . x)^2 x_k^2] = |r|^2 + 2 r_k^2), so tr(Sigma) = E|g|^2 - |G|^2 = (d + 1)|r|^2 + d s^2.
    """

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())

    def forward(self, x, labels):
        residual = x @ self.weight - labels
        return {"loss": 0.5 * residual.pow(2).mean()}


class RegressionRows(torch.utils.data.Dataset):
    """`count` rows {"x", "labels"} with x ~ N(0, I_d) and labels = target . x + N(0, noise_std^2), float64."""

    def __init__(self, count: int, target: torch.Tensor, noise_std: float, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        d = target.numel()
        self.x = torch.randn(count, d, generator=generator, dtype=torch.float64)
        self.labels = self.x @ target.double() + noise_std * torch.randn(
            count, generator=generator, dtype=torch.float64
        )

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        return {"x": self.x[index], "labels": self.labels[index]}


REGRESSION_DIM = 8
REGRESSION_NOISE_STD = 1.0
REGRESSION_TARGET = torch.zeros(REGRESSION_DIM, dtype=torch.float64)
REGRESSION_WEIGHT = torch.full((REGRESSION_DIM,), REGRESSION_DIM**-0.5, dtype=torch.float64)  # |r| = 1


def regression_truth(weight=REGRESSION_WEIGHT, target=REGRESSION_TARGET, noise_std=REGRESSION_NOISE_STD):
    """(|G|^2, tr(Sigma) per sample, noise scale) of `LinearRegression` at `weight` (see its docstring)."""
    d = weight.numel()
    norm_sq = float((weight - target).pow(2).sum())
    variance = (d + 1) * norm_sq + d * noise_std**2
    return norm_sq, variance, variance / norm_sq


class Branches(torch.nn.Module):
    """A regression through `used` (float64, mean loss) with two more branches: `rank0_only` adds to the
    prediction on rank 0 alone, `unused` is never called. Under DDP the first gets a gradient on one rank of two,
    the second on none. The same weights on every rank, whatever the global random state."""

    def __init__(self, rank: int, dim: int = REGRESSION_DIM):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.used, self.rank0_only, self.unused = (
                torch.nn.Linear(dim, 1, dtype=torch.float64) for _ in range(3)
            )
        self.rank = rank

    def forward(self, x, labels):
        prediction = self.used(x)
        if self.rank == 0:
            prediction = prediction + self.rank0_only(x)
        return {"loss": 0.5 * (prediction.squeeze(-1) - labels).pow(2).mean()}


class GradientCapture:
    """Records what each backward pass adds to a one-parameter model's gradient (by a hook of its own, as a copy),
    with the rows of the forward before it: `parts[k]` holds (rows, gradient) for every micro-batch of optimizer
    step k, in order. `step_gradients[k]` is the parameter's `.grad` when the optimizer is about to step (use
    `max_grad_norm=0`: no clipping); `add_to(trainer)` puts its callback on a Trainer."""

    def __init__(self, model: torch.nn.Module):
        from transformers import TrainerCallback

        (self.param,) = [p for p in model.parameters() if p.requires_grad]
        self.parts: list[list[tuple[int, torch.Tensor]]] = []
        self.step_gradients: list[torch.Tensor] = []
        self.rows = 0
        model.register_forward_pre_hook(self._forward, with_kwargs=True)
        self.param.register_hook(self._backward)
        capture = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                capture.parts.append([])

            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                capture.step_gradients.append(capture.param.grad.detach().clone())

        self.callback = Callback()

    def add_to(self, trainer) -> GradientCapture:
        trainer.add_callback(self.callback)
        return self

    def _forward(self, module, args, kwargs):
        x = kwargs.get("x", args[0] if args else None)
        self.rows = int(x.shape[0])

    def _backward(self, grad):
        if self.parts:
            self.parts[-1].append((self.rows, grad.detach().clone()))


class BlockClock:
    """Stands for the `time` module of `adaptive_batch.runtime.memory`: each block a `Stopwatch` times (two readings)
    lasts the next of `durations` seconds, so that tests decide what the eval batch's sizer measures."""

    def __init__(self, durations):
        self.durations, self.now, self.readings = list(durations), 0.0, 0

    def perf_counter(self) -> float:
        if self.readings % 2 == 1:
            self.now += self.durations[self.readings // 2]
        self.readings += 1
        return self.now
