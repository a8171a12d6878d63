"""Which controller cuts a run's steps (by padded tokens, [`tokens.TokenController`], or by rows), and the layout of a
padding collator's steps ([`choose_layout`]). See docs/how-it-works.md, "Variable-length data". Pure Python."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from .config import AdaptiveBatchConfig
from .exactness import Verdict
from .microbatch import CutController, least
from .rows import RowController
from .tokens import TokenController


class RunFacts(Protocol):
    """What the choice reads of the run, each computed on first use (some cost time)."""

    lengths_vary: bool | None  # the dataset's rows differ in length; None: not known before training
    padding_free: bool  # the collator flattens each batch, or the layout flattens them
    start: int  # where "auto" starts: a probed size for this setup, else the per-device batch
    longest_row: int  # tokens of the dataset's longest row (at most max_length)
    memory_limit: float | None  # bytes a micro-batch's peak may reach (None: unknown, as on the CPU)
    oom_is_fatal: bool  # an out-of-memory error cannot be retried (several processes under ZeRO or FSDP2)
    packed_row_tokens: int | None  # tokens of a packed row (TRL's packing: its max_length); None: not packed


def controller_for(config: AdaptiveBatchConfig, facts: RunFacts, row_limit: int) -> CutController:
    budget = config.max_tokens_per_micro_batch
    tune = budget is None and config.auto and facts.lengths_vary and not facts.padding_free
    if tune:
        budget = facts.start * facts.longest_row
    if budget is not None:
        return TokenController(
            budget,
            max_rows=least(config.max_micro_batch_size, None if config.auto else config.micro_batch_size),
            row_limit=row_limit,
            tune=tune,
            overhead=config.micro_batch_overhead,
            memory_limit=facts.memory_limit,
            oom_is_fatal=facts.oom_is_fatal,
        )
    return RowController(
        facts.start if config.auto else config.micro_batch_size,
        auto=config.auto,
        max_size=config.max_micro_batch_size,
        row_limit=row_limit,
        growth_margin=config.growth_margin,
        memory_limit=facts.memory_limit,
        oom_is_fatal=facts.oom_is_fatal,
        row_tokens=facts.packed_row_tokens,
    )


def waits_for_lengths(config: AdaptiveBatchConfig, facts: RunFacts) -> bool:
    """Whether the choice waits for the first step's lengths (`"auto"`, padded, lengths unknown before training)."""
    auto_cut = config.auto and config.max_tokens_per_micro_batch is None
    return auto_cut and facts.lengths_vary is None and not facts.padding_free


# attention implementations that read a flattened step's sequences at work in proportion to their tokens (eager and
# sdpa build a dense mask over all the step's tokens instead)
PACKED_ATTENTION = ("flex", "flash")


@dataclass(frozen=True)
class Layout:
    """How a padding collator's steps run: `flatten`ed into one row of sequences (`in_rows`: each micro-batch's
    sequences packed into rows as wide as the step's longest, for eager and sdpa), or padded (`unmasked`: without the
    padding mask, where the rows are a causal LM's, right-padded); `text` says why."""

    flatten: bool
    text: str
    unmasked: bool = False
    in_rows: bool = False


def choose_layout(
    padding_free: bool | None,
    collator_packs: bool,
    attention: str | None,
    lengths_vary: bool | None,
    causal: bool = False,
    shown: Callable[[Layout], Verdict | None] | None = None,
) -> Layout:
    """The layout for a run (`padding_free` `None`: chosen); `causal`: the rows are a causal LM's whose loss reads the
    mask for attention alone, which under sdpa run without it (docs/how-it-works.md, "Variable-length data").

    `shown`: what a check on the model showed for a layout that packs sequences or leaves the mask out
    ([`runtime.model_checks.check_layout`]; `None`: not checked yet, the layout stands until it is): one the model
    does not compute exactly is replaced by the padded rows (with their mask), and refused where `padding_free=True`
    asked for it. Without `shown` the layout is the one a model that passes gets."""
    layout = _layout(padding_free, collator_packs, attention, lengths_vary, causal)
    if shown is None or not (layout.flatten or layout.unmasked):
        return layout
    verdict = shown(layout)
    if verdict is None or verdict.exact:
        return _with_verdict(layout, verdict)
    if layout.flatten and padding_free:
        raise ValueError(verdict.refusal())
    padded = _layout(False, collator_packs, attention, lengths_vary, causal)
    if layout.unmasked or not padded.unmasked:
        return Layout(False, f"padded, with the padding mask, as {verdict.text()}")
    unmasked = shown(padded)  # (a model that packs wrongly may still need no mask for trailing padding)
    if unmasked is None or unmasked.exact:
        return Layout(False, f"padded{WITHOUT_MASK}; not packed, as {verdict.text()}", unmasked=True)
    return Layout(False, f"padded, with the padding mask, as {verdict.text()}, and {unmasked.text()}")


def _with_verdict(layout: Layout, verdict: Verdict | None) -> Layout:
    if verdict is None:
        return replace(layout, text=f"{layout.text} ({UNCHECKED})")
    return replace(layout, text=f"{layout.text} ({verdict.text()})")


def _layout(
    padding_free: bool | None,
    collator_packs: bool,
    attention: str | None,
    lengths_vary: bool | None,
    causal: bool,
) -> Layout:
    """The layout a model that keeps packed sequences apart (and needs no mask for trailing padding) gets."""
    if collator_packs:
        return Layout(False, "padding-free: the collator flattens each batch into one row of sequences")
    unmasked = causal and attention == "sdpa" and lengths_vary is not False and not padding_free
    packs = attention is not None and any(name in attention for name in PACKED_ATTENTION)
    if padding_free is not None:
        chosen = ("padding-free" + ("" if packs else " in rows")) if padding_free else "padded"
        return Layout(
            padding_free,
            f"{chosen} (padding_free={padding_free}){WITHOUT_MASK if unmasked else ''}",
            unmasked,
            padding_free and not packs,
        )
    if not packs:
        if lengths_vary is False:
            return Layout(False, "padded: the rows are of one length")
        name = attention or "this attention"
        if causal and lengths_vary:
            return Layout(True, f"{IN_ROWS.format(attention=name)}; {OVER_ROWS}", in_rows=True)
        if causal:
            pending = f"until the first step tells the rows' lengths; padding-free in rows if they vary; {OVER_ROWS}"
            return Layout(False, f"padded{WITHOUT_MASK if unmasked else ''} {pending}", unmasked)
        return Layout(
            False,
            "padded: padding-free steps in rows need a causal LM whose inputs only the library's own training_step "
            f"and compute_loss read (a loss of its own may read the padding mask); {SWITCH}",
        )
    if lengths_vary is False:
        return Layout(False, "padded: the rows are of one length, nothing to leave out")
    if lengths_vary is None:
        return Layout(
            False,
            f"padded until the first step tells the rows' lengths; padding-free if they vary ({attention})",
        )
    return Layout(
        True,
        f"padding-free: {attention} reads a flattened step's sequences at no cost beyond their tokens, so no padding "
        "is computed (padding_free=False keeps the padded cut)",
    )


# a layout that packs sequences or leaves the mask out, before a check on the model decided it
UNCHECKED = (
    "where a check on the model before its first step shows it exact; else padded, as the plain Trainer's"
)
WITHOUT_MASK = (
    ", without the padding mask: a causal LM's right-padded rows need none (every pad comes after its row's tokens "
    "and has no label), so sdpa runs its fused causal kernel"
)
# a stated estimate, not a measurement of this run: real tokens/s under flex over sdpa (benchmarks/RESULTS.md)
FLEX_OVER_SDPA = (8291 / 5785, 8352 / 5501)  # the least and the most of the two mixes
# a stated estimate: the default under flex attention (padding-free) over the default under sdpa (padding-free in
# rows), real tokens/s after each run's first step, sft and bimodal mixes (two calls minutes apart on one H100,
# benchmarks/RESULTS.md)
FLEX_OVER_ROWS = (7487 / 6876, 7433 / 6692)

IN_ROWS = (
    "padding-free in rows: each micro-batch's sequences are packed into rows as wide as the step's longest, "
    "position_ids starting again at each, so {attention} masks every row block-diagonally: no padding but the rows' "
    "tails, and no mask over all the step's tokens (padding_free=False keeps the padded cut)"
)
OVER_ROWS = (
    'under attn_implementation="flex_attention" (or a flash attention) padding-free steps need neither rows nor a '
    f"mask: an estimated {FLEX_OVER_ROWS[0]:.2f}-{FLEX_OVER_ROWS[1]:.2f}x the real tokens/s of padding-free in rows "
    "under sdpa (measured on two length mixes, QLoRA 7B, H100; benchmarks/RESULTS.md)"
)

SWITCH = (
    'on rows of varying length padding-free steps under attn_implementation="flex_attention" (or a flash '
    "attention) compute no padding and no cross-sequence mask, and AdaptiveBatch() flattens them there by itself: "
    f"an estimated {FLEX_OVER_SDPA[0]:.1f}-{FLEX_OVER_SDPA[1]:.1f}x the real tokens/s of this layout (measured on "
    "two length mixes, QLoRA 7B, H200; benchmarks/RESULTS.md)"
)
