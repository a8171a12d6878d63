"""Whether a model was shown to compute a layout's micro-batches as the plain Trainer's padded rows: the verdict of
[`runtime.model_checks.check_layout`], and how far two computations of the same logits may differ. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

# How far two exact computations of the same logits may differ in a precision (kernels over other shapes and masks
# add in other orders), as the largest change of a logit over the largest logit of the padded run. A leak across
# sequences changes them far more (0.01 to 1 on the models that leak, tests/test_causal_lms.py).
TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 6e-2, "float16": 1e-2}
# Where only other tokens change (another sequence's, or the padding's), a model that keeps sequences apart computes
# the same numbers: bit for bit where it groups nothing by token, a few units in the last place where a mixture of
# experts groups the tokens it routes (DBRX, PhiMoE: 2 in float64); a leak moves them far more (1e-3 to 1 in the
# sweep). In bf16 and fp16 one unit of the precision, in the largest logit's scale: a leak below it is not seen.
OTHERS_TOLERANCE = {
    "float64": 8 * 2.0**-52,
    "float32": 8 * 2.0**-23,
    "bfloat16": 2.0**-7,
    "float16": 2.0**-10,
}

# what each layout does to the padded rows
CHANGES = {
    "packed": "packed into one row with other sequences",
    "unmasked": "run without the padding mask",
    "trimmed": "cut short of trailing padding",
}


@dataclass(frozen=True)
class Verdict:
    """What a check on the model showed: `difference`, the largest change of a logit (`None`: its forward failed,
    `error` says how), and `loss_difference`, of the loss, against `tolerance`; and `changed_by_others`: how far
    another sequence's (or the padding's) tokens moved a sequence's logits, which an exact model never lets happen."""

    kind: str  # "packed", "unmasked" or "trimmed"
    model: str  # the model's class
    precision: str  # the precision the logits were computed in
    difference: float | None = None
    changed_by_others: float | None = None
    loss_difference: float | None = None  # the loss's relative change (`None`: the model returns no loss)
    error: str | None = None
    loss_precision: str = "float32"  # the precision of the loss the model returns

    @property
    def tolerance(self) -> float:
        return TOLERANCE.get(self.precision, TOLERANCE["bfloat16"])

    @property
    def others_tolerance(self) -> float:
        return OTHERS_TOLERANCE.get(self.precision, OTHERS_TOLERANCE["bfloat16"])

    @property
    def exact(self) -> bool:
        if self.error is not None or self.difference is None:
            return False
        others, loss = self.changed_by_others or 0.0, self.loss_difference or 0.0
        return (
            self.difference <= self.tolerance
            and loss <= self.loss_tolerance
            and others <= self.others_tolerance
        )

    @property
    def loss_tolerance(self) -> float:
        """The tolerance of the less precise of the logits and the loss (transformers computes it in float32)."""
        return max(self.tolerance, TOLERANCE.get(self.loss_precision, TOLERANCE["bfloat16"]))

    def text(self) -> str:
        """One line: what was measured on which model."""
        change = CHANGES[self.kind]
        if self.error is not None:
            return f"{self.model} could not be shown exact with its sequences {change}: {self.error}"
        if self.exact:
            return (
                f"shown exact on {self.model}: logits within {self.difference:.1e} of the padded rows' "
                f"({self.precision} allows {self.tolerance:.0e})"
            )
        allows = f"{self.precision} allows {self.tolerance:.0e}"
        if self.difference > self.tolerance or self.changed_by_others:
            text = f"{self.model} changes a sequence's logits by up to {self.difference:.1e} of the largest ({allows})"
            text += f" when it is {change}"
            if self.changed_by_others:
                text += f", and by {self.changed_by_others:.1e} when only other tokens change"
            return text
        allows = f"{self.loss_precision} allows {self.loss_tolerance:.0e}"
        return f"{self.model} changes its loss by {self.loss_difference:.1e} ({allows}) when its sequences are {change}"

    def refusal(self) -> str:
        """The error for padding-free steps the user asked for (`padding_free=True`) on a model that fails."""
        return (
            f"padding_free=True: {self.text()}, so padding-free steps would train differently from the padded rows "
            "(they need a model that keeps packed sequences apart, each sequence's positions and attention its "
            "own). Pass AdaptiveBatch(padding_free=None), the default, which trains padded where the model is not "
            "shown exact, or padding_free=False."
        )
