"""Show, on the user's own model, that a layout computes what the plain Trainer's padded rows compute, and what the
model's loss computes: a few short forwards before the first step that needs them. See docs/how-it-works.md, "Which
models are packed"."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..core.controllers import Layout
from ..core.exactness import Verdict
from .batch import IGNORE_INDEX, StepBatch
from .compat.torch import tensor_version, uncompiled
from .compat.trainer import attention_implementation, base_model
from .packed import PackedStepBatch, flattened
from .ranks import Ranks

logger = logging.getLogger("adaptive_batch")

# four sequences of other lengths: in rows of 64, the first three fill one row but its tail, the fourth starts another
LENGTHS = (35, 19, 6, 30)
INDEX = "adaptive_batch_token_index"  # a per-token tag that follows each token into the layout (left out of the forward)
ITEMS = 1000.0  # the num_items_in_batch passed: no count of the check's rows
_NONE = object()  # (an attribute a config does not have)
# the problem types of transformers' sequence classifiers whose labels are floats
FLOAT_LABELS = ("regression", "multi_label_classification")


@dataclass(frozen=True)
class ModelLoss:
    """What the loss a model returns computes, shown by [`ModelProbe.loss`] (`None`: it could not be told)."""

    shifts_labels: bool | None = None  # position i scored against label i + 1 (a causal LM's), else label i
    reads_items: bool | None = None  # divides by the `num_items_in_batch` passed, else by its own count


class ModelChecks:
    """The checks of one Trainer's model, each run once (one [`ModelProbe`] a model, attention and cache setting),
    every rank taking what all ranks measured; `pending` while the engine has not placed the model yet (they run at
    the first step). `refusing`: a failed packed layout is refused (`padding_free=True`), so it is not also logged."""

    def __init__(self, trainer, ranks: Ranks, refusing: bool):
        self.trainer, self.ranks, self.refusing = trainer, ranks, refusing
        self.verdicts: dict[tuple, Verdict] = {}
        self.losses: dict[tuple, ModelLoss] = {}
        self.probes: dict[tuple, ModelProbe] = {}
        self.pending = self.hooks = False

    def placed_before_train(self, placed: bool) -> None:
        """Whether the Trainer's model runs before train(); where not, the engine gathers its parameters in hooks."""
        self.pending = self.hooks = not placed

    def verdict(self, layout: Layout, positions: bool) -> Verdict | None:
        """What the check of `layout` showed on the model (`positions`: `position_ids` replace the padding mask);
        `None` while pending."""
        kind = "packed" if layout.flatten else "unmasked"
        return self._verdict(kind, layout.in_rows, positions and kind == "unmasked")

    def trims(self) -> bool:
        """Whether a padded micro-batch may be cut short of its trailing padding (a model whose rows depend on their
        padding, as one that builds its own mask for left padding, keeps the step's width); `True` while pending."""
        verdict = self._verdict("trimmed", False, False)
        return verdict is None or verdict.exact

    def loss(self) -> ModelLoss:
        """What the model's loss computes; nothing told while pending."""
        if self.waiting:
            return ModelLoss()
        key = self._key()
        if key not in self.losses:
            with self._as_trained():
                told = self._probe(key).loss()
            # every rank the same: a fact told differently on some rank is not told
            values = [
                -1.0 if value is None else float(value) for value in (told.shifts_labels, told.reads_items)
            ]
            high, low = self.ranks.max(values), [-v for v in self.ranks.max([-v for v in values])]
            self.losses[key] = ModelLoss(
                *(bool(h) if h == lo and h >= 0 else None for h, lo in zip(high, low))
            )
        return self.losses[key]

    def _verdict(self, kind: str, in_rows: bool, positions: bool) -> Verdict | None:
        key = (kind, in_rows, positions, *self._key())
        if key not in self.verdicts:
            if self.waiting:
                return None
            with self._as_trained():
                verdict = self._probe(self._key()).layout(kind, in_rows, positions)
            self.verdicts[key] = verdict = self._agreed(verdict)
            # (the plan table's layout row says it too; a refused padding_free=True says it in its error)
            if (
                not verdict.exact
                and self.trainer.args.should_log
                and not (self.refusing and kind == "packed")
            ):
                consequence = (
                    "micro-batches keep their step's full width" if kind == "trimmed" else "steps run padded"
                )
                logger.warning("AdaptiveBatch: %s: %s.", consequence, verdict.text())
        return self.verdicts[key]

    @property
    def waiting(self) -> bool:
        """Pending, or no model yet (`model_init`: the Trainer makes it in train())."""
        return self.pending or self.trainer.model is None

    def _key(self) -> tuple:
        model = self.trainer.model
        return id(model), attention_implementation(model), getattr(self.trainer.args, "use_cache", None)

    def _probe(self, key: tuple) -> ModelProbe:
        if key not in self.probes:
            items = bool(getattr(self.trainer, "model_accepts_loss_kwargs", False))  # (it sees `**kwargs`)
            autocast = self.trainer.accelerator.autocast
            self.probes[key] = ModelProbe(
                self.trainer.model, autocast, own_hooks=self.hooks, passes_items=items
            )
        return self.probes[key]

    @contextlib.contextmanager
    def _as_trained(self):
        """The model's `config.use_cache` as the Trainer trains with it (`args.use_cache`: it sets it after
        `on_init_end`, where AdaptiveBatch first plans, also on a config of the user's that has none), back as it was
        after."""
        config = getattr(base_model(self.trainer.model), "config", None)
        wanted = getattr(self.trainer.args, "use_cache", None)
        if config is None or wanted is None:
            yield
            return
        kept, config.use_cache = getattr(config, "use_cache", _NONE), wanted
        try:
            yield
        finally:
            if kept is _NONE:
                del config.use_cache
            else:
                config.use_cache = kept

    def _agreed(self, verdict: Verdict) -> Verdict:
        failed = verdict.error is not None or verdict.difference is None
        loss = -1.0 if verdict.loss_difference is None else verdict.loss_difference
        measured = [
            math.inf if failed else verdict.difference,
            verdict.changed_by_others or 0.0,
            loss,
            float(failed),
        ]
        difference, others, loss, failed_anywhere = self.ranks.max(measured)
        error = verdict.error or ("the check failed on another rank" if failed_anywhere else None)
        return replace(
            verdict,
            difference=None if error else difference,
            changed_by_others=others,
            loss_difference=None if loss < 0 else loss,
            error=error,
        )


def check_layout(
    model: torch.nn.Module, kind: str, in_rows: bool = False, positions: bool = False, **probe
) -> Verdict:
    """[`ModelProbe.layout`] of a probe made for this check alone (`probe`: its keyword arguments)."""
    return ModelProbe(model, **probe).layout(kind, in_rows, positions)


def check_loss(model: torch.nn.Module, **probe) -> ModelLoss:
    """[`ModelProbe.loss`] of a probe made for this check alone."""
    return ModelProbe(model, **probe).loss()


class ModelProbe:
    """Forwards of one model on four right-padded sequences, against which layouts are compared: the padded rows with
    their mask and labels, as a padding collator gives them (the reference, run once).

    Every forward leaves no trace ([`_quietly`]): eval mode, no gradient but the one backward of a layout (into a few
    parameters, not `.grad`), the RNG and buffers as they were. `own_hooks`: call the model's own forward hooks (an
    engine that gathers parameters in them: DeepSpeed ZeRO-3, FSDP2), else a user's token counter does not see the
    check. `autocast`: the precision context training runs in. `passes_items`: the Trainer passes
    `num_items_in_batch` (the model's forward takes `**kwargs`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        own_hooks: bool = False,
        passes_items: bool = True,
    ):
        self.model, self.inner, self.embeddings = _parts(model)
        self.autocast, self.passes_items = autocast, passes_items
        self.forward = self.model if own_hooks else getattr(self.model, "forward", None)
        self.forwards: _Forwards | None = None

    def layout(self, kind: str, in_rows: bool = False, positions: bool = False) -> Verdict:
        """Whether the model computes the sequences the same when `kind` is "packed" (flattened into one row,
        `in_rows`: into rows as the sdpa and eager layout makes them), "unmasked" (padded rows without the mask,
        `positions`: with `position_ids`) or "trimmed" (cut short of trailing padding), as the step runner would give
        them: the logits and the loss against the reference's, a finite gradient, and the logits against the same
        layout where only other tokens differ (another sequence's, the padding's), which an exact model never sees."""
        name = type(self.inner).__name__
        if self.embeddings is None:
            return Verdict(
                kind, name, "float32", error="it has no input embeddings to read the vocabulary from"
            )
        with self._quietly():
            precision = _precision(self.model, self.embeddings.weight.device)
            try:
                forwards = self._forwards()
                forwards.check_per_token()
                if kind == "packed":
                    measured = forwards.packed(in_rows)
                else:
                    measured = forwards.unmasked(positions) if kind == "unmasked" else forwards.trimmed()
            except (NonFiniteGradient, NotPerToken) as error:
                return Verdict(kind, name, precision, error=str(error))
            except Exception as error:  # noqa: BLE001 - any failure means "not shown exact"; the verdict says which
                return Verdict(kind, name, precision, error=f"its forward raised {_first_line(error)}")
        return Verdict(kind, name, precision, *measured, loss_precision=forwards.loss_precision)

    def loss(self) -> ModelLoss:
        """Whether the loss scores the label at each row's first position (then it does not shift labels: position
        i is scored against label i), and whether it divides by the `num_items_in_batch` passed (halved when that
        doubles) or is its own mean (unchanged); told by changing what each would change, whatever its formula."""
        if self.embeddings is None:
            return ModelLoss()
        with self._quietly():
            try:
                return self._forwards().loss()
            except Exception:  # noqa: BLE001 - a loss that cannot be told is left to the Trainer's own reading
                return ModelLoss()

    def _forwards(self) -> _Forwards:
        if self.forwards is None:
            self.forwards = _Forwards(self.forward, self.inner, self.embeddings, self.passes_items)
        return self.forwards

    def _quietly(self):
        return _quietly(self.model, self.embeddings.weight.device, self.autocast)


class NonFiniteGradient(Exception):
    """A layout's backward gives a NaN or an infinity where the padded rows' does not."""


class NotPerToken(Exception):
    """The model's output is not one logit vector per token (a classifier's is one per row): no layout's logits can
    be compared with the padded rows'."""


class _Forwards:
    """The reference forward (the padded rows with their mask and labels) and the comparisons of layouts with it."""

    def __init__(self, forward: Callable, inner: torch.nn.Module, embeddings, passes_items: bool):
        self.forward, self.device = forward, embeddings.weight.device
        # the gradients a backward is checked in: the small trainable parameters (norms, biases, LoRA's), each layer's
        trainable = [p for p in inner.parameters() if p.requires_grad]
        self.watched = [p for p in trainable if p.numel() <= 1 << 20] or sorted(trainable, key=torch.numel)[
            :1
        ]
        self.loss_precision, self.precise = "float32", True
        self.config = config = getattr(inner, "config", None)
        special = {getattr(config, key, None) for key in ("pad_token_id", "bos_token_id", "eos_token_id")}
        self.pad = getattr(config, "pad_token_id", None) or 0
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        vocab = min(embeddings.num_embeddings, getattr(text, "vocab_size", None) or embeddings.num_embeddings)
        allowed = torch.tensor([i for i in range(min(vocab, 4096)) if i not in special])
        generator = torch.Generator().manual_seed(0)
        self.tokens = lambda n: allowed[torch.randint(len(allowed), (n,), generator=generator)]
        self.items = {"num_items_in_batch": torch.tensor(ITEMS, device=self.device)} if passes_items else {}
        rows = self._padded([self.tokens(n) for n in LENGTHS])
        self.width = rows["input_ids"].shape[1]
        self.batch = self._for_head(rows)
        self.reference, self.reference_loss = self._run(self.batch, labels=True, per_token=False)

    def check_per_token(self) -> None:
        """Raise [`NotPerToken`] where the padded rows' output is not one logit vector per token."""
        _check_per_token(self.reference, self.batch["input_ids"])

    def packed(self, in_rows: bool) -> tuple[float, float, float | None]:
        """The layout's micro-batch of the sequences against the padded rows (logits, loss), and its logits against
        the same micro-batch where the sequence that starts the first row holds other tokens."""
        laid_out = self._packed(self.batch, in_rows)
        row = (int(laid_out[INDEX][0, 0]) - 1) // self.width  # the padded row of the sequence starting row 0
        other = dict(self.batch, input_ids=self.batch["input_ids"].clone())
        other["input_ids"][row, : LENGTHS[row]] = self.tokens(LENGTHS[row])
        logits, loss = self._run(laid_out, labels=True, backward=True)
        others, _ = self._run(self._packed(other, in_rows))
        index = laid_out[INDEX]
        kept = index > 0
        reference = self.reference.reshape(-1, self.reference.shape[-1])[index[kept] - 1]
        not_first = kept & ((index - 1) // self.width != row)
        return (
            self._relative(logits[kept], reference, logits),
            self._relative(others[not_first], logits[not_first]),
            _loss_change(loss, self.reference_loss),
        )

    def unmasked(self, positions: bool) -> tuple[float, float, float | None]:
        """The padded rows without their mask against the padded rows (logits, loss), and their logits against the
        same where the padding holds other tokens."""
        batch = StepBatch(self.batch, unmasked=True, positions=positions)
        if not batch.unmasked:
            raise RuntimeError("the check's padded rows keep their mask")
        other = StepBatch(self._other_padding(self.batch), unmasked=True, positions=positions)
        size = len(LENGTHS)
        logits, loss = self._run(batch.take(0, size), labels=True, backward=True)
        others, _ = self._run(other.take(0, size))
        real = self.batch["attention_mask"][batch.order].bool()[:, : logits.shape[1]]
        reference = self.reference[batch.order][:, : logits.shape[1]]
        return (
            self._relative(logits[real], reference[real], logits),
            self._relative(others[real], logits[real]),
            _loss_change(loss, self.reference_loss),
        )

    def trimmed(self) -> tuple[float, float, float | None]:
        """The rows but the longest, cut short of the padding the longest made them carry, against the reference's
        (logits; the loss against the same rows at the full width), and the reference's logits against the same rows
        where that padding holds other tokens."""
        rows = {key: value[1:] for key, value in self.batch.items()}
        width = max(LENGTHS[1:])
        full, full_loss = self._run(rows, labels=True)
        logits, loss = self._run(
            {key: value[:, :width].contiguous() for key, value in rows.items()}, labels=True
        )
        others, _ = self._run(self._other_padding(rows))
        real = rows["attention_mask"].bool()
        return (
            self._relative(logits[real[:, :width]], self.reference[1:, :width][real[:, :width]], logits),
            self._relative(others[real], self.reference[1:][real]),
            _loss_change(loss, full_loss),
        )

    def loss(self) -> ModelLoss:
        """[`ModelProbe.loss`]; no label shift to tell where the labels are not one per token (a row's label)."""
        if self.reference_loss is None:
            return ModelLoss()
        shifts = None
        if self.batch["labels"].shape == self.batch["input_ids"].shape:
            labels = self.batch["labels"].clone()
            labels[:, 0] = IGNORE_INDEX
            _, without_first = self._run(dict(self.batch, labels=labels), labels=True, per_token=False)
            # a loss that shifts never scores the first label: the same numbers in the same order, bit for bit
            shifts = None if without_first is None else without_first == self.reference_loss
        return ModelLoss(shifts_labels=shifts, reads_items=self._reads_items())

    def _reads_items(self) -> bool | None:
        if not self.items:
            return None
        self.items = {"num_items_in_batch": torch.tensor(2 * ITEMS, device=self.device)}
        try:
            _, doubled = self._run(self.batch, labels=True, per_token=False)
        finally:
            self.items = {"num_items_in_batch": torch.tensor(ITEMS, device=self.device)}
        ratio = self.reference_loss / doubled if doubled else math.nan
        fits = 1e-6 if self.precise else 1e-2  # (a loss computed in its logits' precision)
        return True if abs(ratio - 2) <= 2 * fits else False if abs(ratio - 1) <= fits else None

    def _padded(self, sequences: list[torch.Tensor]) -> dict:
        """Right-padded rows with their mask and labels (-100 on padding), as a padding collator makes them."""
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, sequence in enumerate(sequences):
            ids[row, : len(sequence)], mask[row, : len(sequence)] = sequence, 1
        labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    def _for_head(self, rows: dict) -> dict:
        """The padded rows labelled as the model's head scores them, told by a forward without labels: a label per
        token from its classes where it returns a logit vector per token (a language model's vocabulary, a token
        classifier's labels); a label per row where it returns one vector per row (a sequence classifier's class, or
        floats for a regression or multi-label head); rows of two choices where only those run (multiple choice).
        Where no forward runs without labels (a seq2seq LM makes its decoder's inputs from them), the tokens are the
        labels. (Labels outside the head's classes would stop a CUDA device at its first forward.)"""
        unlabelled = {key: value for key, value in rows.items() if key != "labels"}
        logits = self._logits(unlabelled)
        if logits is None:
            choices = {key: value.unsqueeze(1).repeat(1, 2, 1) for key, value in unlabelled.items()}
            logits = self._logits(choices)
            if logits is None or logits.shape != (len(LENGTHS), 2):
                return rows
            unlabelled = choices
        ids, classes = rows["input_ids"], logits.shape[-1]
        if logits.dim() == 3 and logits.shape[:2] == ids.shape:
            labels = rows["labels"]
            return dict(rows, labels=torch.where(labels == IGNORE_INDEX, labels, labels % classes))
        if logits.dim() != 2 or logits.shape[0] != len(LENGTHS):
            return rows
        if classes == 1 or getattr(self.config, "problem_type", None) in FLOAT_LABELS:
            labels = (torch.arange(logits.numel()) % 2).reshape(logits.shape).to(logits.dtype)
        else:
            labels = torch.arange(len(LENGTHS)) % classes
        return dict(unlabelled, labels=labels)

    def _logits(self, batch: dict) -> torch.Tensor | None:
        """The logits of a forward on `batch` without labels; `None` where it raises or returns none."""
        try:
            output = self.forward(**{k: v.to(self.device) for k, v in batch.items()}, **self.items)
        except Exception:  # noqa: BLE001 - a forward that needs labels or other inputs: the caller tries another
            return None
        logits = _output(output, "logits")
        return logits.detach() if torch.is_tensor(logits) else None

    def _other_padding(self, rows: dict) -> dict:
        """`rows` with other tokens in their padding."""
        padding = rows["attention_mask"] == 0
        return dict(
            rows, input_ids=rows["input_ids"].masked_scatter(padding, self.tokens(int(padding.sum())))
        )

    def _packed(self, batch: dict, in_rows: bool) -> dict:
        """The micro-batch of every sequence the step runner would give the model, each token tagged by `INDEX`."""
        index = torch.arange(1, batch["input_ids"].numel() + 1).reshape(-1, self.width)
        packed = PackedStepBatch(flattened(dict(batch, **{INDEX: index})), rows=in_rows)
        return packed.take(0, packed.rows)

    def _run(
        self, batch: dict, labels: bool = False, backward: bool = False, per_token: bool = True
    ) -> tuple[torch.Tensor | None, float | None]:
        """The logits (float64, on the CPU; `None` where it returns none) and, with `labels`, the loss of a forward on
        `batch`; `backward`: raise [`NonFiniteGradient`] where the loss's gradient is not finite (a NaN in a row's
        unused tail has no label, yet it reaches the parameters' gradients); `per_token`: raise [`NotPerToken`] where
        the logits are not one vector per token."""
        # (labels always: a model may require them; `labels=False` only leaves the loss unread)
        inputs = {k: v.to(self.device) for k, v in batch.items() if k != INDEX}
        backward = backward and bool(self.watched)
        with torch.enable_grad() if backward else contextlib.nullcontext():
            # (no use_cache=False: training runs with the config's, and a cache mixes packed sequences)
            output = self.forward(**inputs, **self.items)
            loss, logits = _output(output, "loss") if labels else None, _output(output, "logits")
            if backward and torch.is_tensor(loss) and loss.requires_grad:
                gradients = torch.autograd.grad(loss, self.watched, allow_unused=True)
                if not all(g is None or bool(torch.isfinite(g).all()) for g in gradients):
                    raise NonFiniteGradient("its backward gives a non-finite gradient (NaN or inf)")
        if per_token:
            _check_per_token(logits, inputs["input_ids"])
        kept = None
        if torch.is_tensor(logits):
            self.precise = logits.dtype in (torch.float32, torch.float64)
            # (the first 4096 of the vocabulary: a change of a hidden state shows in any of them; small on the CPU)
            kept = logits.detach()[..., :4096].double().cpu()
        if not torch.is_tensor(loss):
            return kept, None
        self.loss_precision = str(loss.dtype).removeprefix("torch.")  # (transformers' losses are in float32)
        return kept, float(loss)

    def _relative(self, a: torch.Tensor, b: torch.Tensor, whole: torch.Tensor | None = None) -> float:
        """The largest difference of `a` and `b` over the largest logit of the padded rows; infinite where `whole` (all
        the layout's logits, a row's unused tail's too) is not finite: through the backward, a NaN reaches every
        gradient, whatever its label."""
        if whole is not None and not bool(torch.isfinite(whole).all()):
            return math.inf
        if a.numel() == 0:
            return 0.0
        scale = self.reference.abs().max().clamp_min(torch.finfo(torch.float64).tiny)
        difference = (a - b).abs().max() / scale
        return float(difference) if torch.isfinite(difference) else math.inf


def _output(output, name: str):
    """A model output's `loss` or `logits`, as the Trainer reads them: a field, a dict's key, or a tuple's first items
    (the loss first where there is one, maybe alone)."""
    if isinstance(output, dict):
        return output.get(name)
    if isinstance(output, (tuple, list)):
        has_loss = len(output) > 0 and torch.is_tensor(output[0]) and output[0].dim() == 0
        if name == "loss":
            return output[0] if has_loss else None
        return output[int(has_loss)] if len(output) > int(has_loss) else None
    return getattr(output, name, None)


def _check_per_token(logits, ids: torch.Tensor) -> None:
    if not torch.is_tensor(logits) or logits.shape[:2] != ids.shape:
        shape = list(logits.shape) if torch.is_tensor(logits) else "none"
        raise NotPerToken(
            f"its output is not one logit vector per token ({shape} for inputs {list(ids.shape)})"
        )


def _loss_change(loss: float | None, reference: float | None) -> float | None:
    """How far a layout's loss is from the padded rows', relative (`None` where the model returns none)."""
    if loss is None or reference is None:
        return None if loss is None and reference is None else math.inf
    difference = abs(loss - reference) / max(abs(reference), 1e-12)
    return difference if math.isfinite(difference) else math.inf


def _parts(model: torch.nn.Module):
    """The module to call (DDP's wrapper would broadcast buffers; a compiled one would compile), the model inside PEFT's
    wrapper, and its input embeddings (`None` where it has none)."""
    model = uncompiled(getattr(model, "module", model))
    inner = base_model(model)
    try:  # (transformers' own raises NotImplementedError on a PreTrainedModel without input embeddings)
        embeddings = inner.get_input_embeddings() if hasattr(inner, "get_input_embeddings") else None
    except NotImplementedError:
        embeddings = None
    return model, inner, embeddings if isinstance(getattr(embeddings, "weight", None), torch.Tensor) else None


@contextlib.contextmanager
def _quietly(model: torch.nn.Module, device: torch.device, autocast: Callable):
    """Eval mode (no dropout), no gradient, the RNG and any buffer a forward changes put back, in training's
    precision."""
    devices = [device.index or 0] if device.type == "cuda" else []
    with _eval_mode(model), _buffers_kept(model), torch.random.fork_rng(devices=devices), torch.no_grad():
        with _problem_type_kept(base_model(model)), autocast():
            yield


def _first_line(error: BaseException) -> str:
    line = (str(error).strip().splitlines() or [""])[0][:200]
    return f"{type(error).__name__}: {line}"


def _precision(model: torch.nn.Module, device: torch.device) -> str:
    """The least precise of what the forward computes in: autocast's, the floating parameters', a 4-bit layer's
    `compute_dtype` (bitsandbytes)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    dtypes |= {
        m.compute_dtype for m in model.modules() if isinstance(getattr(m, "compute_dtype", None), torch.dtype)
    }
    if torch.is_autocast_enabled(device.type):
        dtypes.add(torch.get_autocast_dtype(device.type))
    least = max(dtypes or {torch.float32}, key=lambda dtype: torch.finfo(dtype).eps)
    return str(least).removeprefix("torch.")


@contextlib.contextmanager
def _problem_type_kept(model: torch.nn.Module):
    """`config.problem_type` back as it was: a classifier's forward sets it from the first labels it sees
    (transformers' sequence classifiers), and the check's labels must not decide it for the user's."""
    config = getattr(model, "config", None)
    kept = getattr(config, "problem_type", None)
    try:
        yield
    finally:
        if getattr(config, "problem_type", None) != kept:
            config.problem_type = kept


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module):
    """Eval mode (no dropout) for the check; every module's own mode back after."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


@contextlib.contextmanager
def _buffers_kept(model: torch.nn.Module):
    """A buffer a forward changes in place (a cache of positions grown by a longer input) is put back."""
    kept = [
        (buffer, tensor_version(buffer), buffer.detach().to("cpu", copy=True)) for buffer in model.buffers()
    ]
    try:
        yield
    finally:
        for buffer, version, value in kept:
            if tensor_version(buffer) != version:
                with torch.no_grad():
                    buffer.copy_(value.to(buffer.device))
