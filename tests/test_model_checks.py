"""The checks on the user's own model before a layout's first step ([`runtime.model_checks`]): what they measure on
models that keep packed sequences apart and on models that do not, what they tell of a model's loss, that they leave
no trace, and the layout and the refusal they lead to ([`core.controllers.choose_layout`])."""

import pytest
import torch
from helpers import QUIET_CPU_RUN
from transformers import (
    BartConfig,
    BartForCausalLM,
    FalconConfig,
    FalconForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Trainer,
    TrainingArguments,
)

from adaptive_batch import AdaptiveBatch
from adaptive_batch.core.controllers import UNCHECKED, choose_layout
from adaptive_batch.core.exactness import TOLERANCE, Verdict
from adaptive_batch.runtime.model_checks import ModelLoss, check_layout, check_loss


def llama(**extra):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        use_cache=False,  # (as the Trainer trains: args.use_cache; a cache turns packing detection off)
        **extra,
    )
    return LlamaForCausalLM(config).double()


def opt():
    torch.manual_seed(0)
    config = OPTConfig(
        vocab_size=128,
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=32,
        use_cache=False,
    )
    return OPTForCausalLM(config).double()


def falcon_alibi():
    torch.manual_seed(0)
    config = FalconConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=16, alibi=True
    )
    return FalconForCausalLM(config).double()


def bart():
    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=128,
        d_model=32,
        decoder_layers=2,
        decoder_attention_heads=4,
        decoder_ffn_dim=64,
        encoder_layers=1,
        encoder_attention_heads=4,
        encoder_ffn_dim=64,
        max_position_embeddings=128,
        use_cache=False,  # (as the Trainer trains it: args.use_cache)
    )
    return BartForCausalLM(config).double()


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("in_rows", [True, False], ids=["in rows", "one row"])
def test_a_llama_is_shown_to_keep_packed_sequences_apart(attention, in_rows):
    model = llama()
    model.config._attn_implementation = attention
    verdict = check_layout(model, "packed", in_rows)
    assert verdict.exact and verdict.precision == "float64" and verdict.error is None
    assert verdict.difference <= TOLERANCE["float64"] and verdict.changed_by_others == 0.0
    assert verdict.text().startswith("shown exact on LlamaForCausalLM: logits within")
    assert check_layout(model, "unmasked", positions=True).exact


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_model_that_builds_its_mask_without_position_ids_is_shown_to_mix_packed_sequences(attention):
    model = opt()
    model.config._attn_implementation = attention
    verdict = check_layout(model, "packed", in_rows=True)
    assert not verdict.exact and verdict.difference > 1e-2 and verdict.changed_by_others > 1e-3
    assert verdict.text().startswith("OPTForCausalLM changes a sequence's logits by up to ")
    assert "when it is packed into one row with other sequences, and by" in verdict.text()
    assert check_layout(model, "unmasked").exact  # trailing padding: causal, its mask changes nothing


def test_a_cache_is_seen_to_mix_packed_sequences():
    model = llama()
    model.config.use_cache = True  # (a cache turns transformers' packing detection off)
    verdict = check_layout(model, "packed", in_rows=True)
    assert not verdict.exact and verdict.changed_by_others > 1e-3


def test_a_position_bias_that_counts_over_the_whole_row_is_seen():
    verdict = check_layout(falcon_alibi(), "packed", in_rows=True)
    assert not verdict.exact and verdict.difference > 1e-6


def test_a_forward_that_fails_is_not_shown_exact_and_says_why():
    class NoPositions(torch.nn.Module):  # a custom model whose forward takes no position_ids
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(16, 4)

        def get_input_embeddings(self):
            return self.embed

        def forward(self, input_ids, attention_mask=None, labels=None):
            return (self.embed(input_ids),)

    verdict = check_layout(NoPositions(), "packed", passes_items=False)  # (its forward takes no loss kwargs)
    assert not verdict.exact and verdict.error.startswith("its forward raised TypeError: ")
    assert "position_ids" in verdict.error
    assert verdict.text().startswith(
        "NoPositions could not be shown exact with its sequences packed into one row"
    )


def test_the_check_leaves_no_trace():
    model = llama()
    model.config._attn_implementation = "sdpa"
    model.train()
    model.model.layers[0].eval()  # a mode of the user's own, kept
    modes = [m.training for m in model.modules()]
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    seen = []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs), with_kwargs=True)
    torch.manual_seed(1)
    rng = torch.get_rng_state()
    check_layout(model, "packed", in_rows=True)
    check_loss(model, passes_items=True)
    assert torch.equal(torch.get_rng_state(), rng)
    assert [m.training for m in model.modules()] == modes
    assert all(torch.equal(b, buffers[name]) for name, b in model.named_buffers())
    assert all(p.grad is None for p in model.parameters())
    assert seen == []  # a user's hook on the model (a token counter) sees none of the check's forwards
    check_layout(
        model, "packed", in_rows=True, own_hooks=True
    )  # an engine that gathers parameters in its hooks
    assert len(seen) >= 3 and all("input_ids" in kwargs for kwargs in seen)  # padded, laid out, other tokens


def test_the_loss_check_tells_the_label_shift_and_the_divisor():
    assert check_loss(llama(), passes_items=True) == ModelLoss(shifts_labels=True, reads_items=True)
    assert check_loss(llama(), passes_items=False) == ModelLoss(shifts_labels=True, reads_items=None)
    # BartForCausalLM scores position i against label i, and returns its own mean whatever num_items_in_batch says
    assert check_loss(bart(), passes_items=True) == ModelLoss(shifts_labels=False, reads_items=False)


def test_a_loss_that_the_count_passed_does_not_divide_tells_nothing_of_it():
    model = llama()
    forward = model.forward

    def forward_with_a_penalty(*args, **kwargs):
        output = forward(*args, **kwargs)
        if output.loss is not None:
            output.loss = output.loss + 0.5  # (a z-loss, a penalty: not divided by num_items_in_batch)
        return output

    model.forward = forward_with_a_penalty
    # the first label is still never scored; whether the loss reads num_items_in_batch cannot be told
    assert check_loss(model, passes_items=True) == ModelLoss(shifts_labels=True, reads_items=None)


def failing(kind: str) -> Verdict:
    return Verdict(kind, "OPTForCausalLM", "float64", difference=0.38, changed_by_others=0.11)


def test_a_layout_the_model_fails_falls_back_to_the_padded_rows_and_says_why():
    def shown(layout):
        return (
            failing("packed")
            if layout.flatten
            else Verdict("unmasked", "OPTForCausalLM", "float64", 0.0, 0.0)
        )

    layout = choose_layout(None, False, "sdpa", True, causal=True, shown=shown)
    assert not layout.flatten and layout.unmasked  # padded, and without the mask, which the model passed
    assert layout.text.startswith("padded, without the padding mask")
    assert "not packed, as OPTForCausalLM changes a sequence's logits by up to 3.8e-01" in layout.text
    layout = choose_layout(
        None,
        False,
        "sdpa",
        True,
        causal=True,
        shown=lambda layout: failing("packed" if layout.flatten else "unmasked"),
    )
    assert not layout.flatten and not layout.unmasked
    assert layout.text.startswith("padded, with the padding mask, as OPTForCausalLM changes")
    assert "and OPTForCausalLM changes a sequence's logits by up to 3.8e-01" in layout.text
    eager = choose_layout(None, False, "eager", True, causal=True, shown=lambda layout: failing("packed"))
    assert (
        not eager.flatten
        and not eager.unmasked
        and eager.text.startswith("padded, with the padding mask, as")
    )


def test_padding_free_true_on_a_model_that_fails_is_refused_with_what_was_measured_and_the_fix():
    with pytest.raises(ValueError) as refused:
        choose_layout(True, False, "sdpa", True, causal=True, shown=lambda layout: failing("packed"))
    message = str(refused.value)
    assert message.startswith(
        "padding_free=True: OPTForCausalLM changes a sequence's logits by up to 3.8e-01"
    )
    assert "(float64 allows 1e-09)" in message and "by 1.1e-01 when only other tokens change" in message
    assert (
        "Pass AdaptiveBatch(padding_free=None), the default" in message and "or padding_free=False" in message
    )


def test_a_layout_stands_until_a_pending_check_and_names_it():
    layout = choose_layout(None, False, "sdpa", True, causal=True, shown=lambda layout: None)
    assert layout.flatten and layout.in_rows
    assert layout.text.endswith(f"({UNCHECKED})")
    passed = Verdict("packed", "LlamaForCausalLM", "bfloat16", difference=4.6e-3, changed_by_others=0.0)
    layout = choose_layout(None, False, "sdpa", True, causal=True, shown=lambda layout: passed)
    assert layout.flatten and layout.text.endswith(
        "(shown exact on LlamaForCausalLM: logits within 4.6e-03 of the padded rows' (bfloat16 allows 6e-02))"
    )


class RegressionConfig(PretrainedConfig):
    model_type = "adaptive-batch-regression"


class RegressionModel(PreTrainedModel):
    """A PreTrainedModel without input embeddings: transformers' `get_input_embeddings` raises on it."""

    config_class = RegressionConfig

    def __init__(self, config):
        super().__init__(config)
        self.weight = torch.nn.Parameter(torch.tensor([0.5, -0.25], dtype=torch.float64))

    def forward(self, x, labels=None):
        prediction = x @ self.weight
        return {"loss": torch.nn.functional.mse_loss(prediction, labels), "logits": prediction}


def test_a_pretrained_model_without_input_embeddings_trains_as_under_the_plain_trainer(tmp_path):
    generator = torch.Generator().manual_seed(0)
    rows = [
        {
            "x": torch.randn(2, generator=generator, dtype=torch.float64),
            "labels": torch.tensor(1.0, dtype=torch.float64),
        }
        for _ in range(16)
    ]

    def trained(callbacks):
        model = RegressionModel(RegressionConfig())
        args = TrainingArguments(
            str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, **QUIET_CPU_RUN
        )
        Trainer(model=model, args=args, train_dataset=rows, callbacks=callbacks).train()
        return model.weight.detach()

    assert torch.allclose(trained([AdaptiveBatch(micro_batch_size=2)]), trained([]), rtol=1e-12, atol=0)
