"""A model of the user's own whose loss is its micro-batch's mean and ignores `num_items_in_batch`, though its
forward takes `**kwargs`: the Trainer then passes the count and leaves the loss undivided, so the plain Trainer's
step is the sum of its micro-batches' means. Cut otherwise, the step keeps that scale: the check on the model tells
the loss ignores the count ([`model_checks.check_loss`]) and each micro-batch is weighted by its share of the step's
label tokens times the plain Trainer's micro-batches ([`hf.loss_scale`]); one warning names the model."""

import pytest
import torch
from helpers import ORDER_TOLERANCE, QUIET_CPU_RUN, assert_close_parameters, logged, parameters
from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainingArguments

from adaptive_batch import AdaptiveBatch
from adaptive_batch.runtime.model_checks import ModelLoss, check_loss

VOCAB = 32


class TinyMeanConfig(PretrainedConfig):
    model_type = "tiny_mean_loss"

    def __init__(self, vocab_size: int = VOCAB, hidden_size: int = 8, logits: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.hidden_size, self.logits = vocab_size, hidden_size, logits


class TinyMeanLossModel(PreTrainedModel):
    """Scores each token against its label (a token and its left neighbour in), its loss the micro-batch's mean over
    its labels, whatever `num_items_in_batch` says; `config.logits=False`: it returns its loss alone."""

    config_class = TinyMeanConfig

    def __init__(self, config: TinyMeanConfig):
        super().__init__(config)
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.mix = torch.nn.Linear(2 * config.hidden_size, config.hidden_size)
        self.head = torch.nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        hidden = self.embed_tokens(input_ids)
        left = torch.nn.functional.pad(hidden, (0, 0, 1, 0))[:, :-1]
        logits = self.head(torch.tanh(self.mix(torch.cat([hidden, left], dim=-1))))
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), labels.flatten(), ignore_index=-100
            )
        return {"loss": loss, "logits": logits} if self.config.logits else {"loss": loss}


def model(logits: bool = True) -> TinyMeanLossModel:
    torch.manual_seed(0)
    return TinyMeanLossModel(TinyMeanConfig(logits=logits)).double()


def rows(ragged: bool) -> list[dict]:
    """16 rows, every token labelled: of one length (so the plain Trainer's micro-batches hold as many labels, and its
    sum of their means is the step's mean times their count), or of 3 to 11 tokens."""
    generator = torch.Generator().manual_seed(0)
    lengths = [3 + (5 * row) % 9 if ragged else 6 for row in range(16)]
    ids = [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in lengths]
    return [{"input_ids": row, "labels": row} for row in ids]


def pad_rows(samples: list[dict]) -> dict:
    width = max(len(sample["input_ids"]) for sample in samples)

    def padded(key, fill):
        return torch.tensor([s[key] + [fill] * (width - len(s[key])) for s in samples])

    mask = [[1] * len(s["input_ids"]) + [0] * (width - len(s["input_ids"])) for s in samples]
    return {
        "input_ids": padded("input_ids", 0),
        "attention_mask": torch.tensor(mask),
        "labels": padded("labels", -100),
    }


def train(tmp_path, callbacks, per_device, accumulation, ragged=False, logits=True):
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        num_train_epochs=1,
        optim="sgd",
        learning_rate=0.1,
        max_grad_norm=0.0,  # (a gradient at the wrong scale shows in the update, not clipped to the same norm)
        **QUIET_CPU_RUN,
    )
    trainer = Trainer(
        model=model(logits),
        args=args,
        train_dataset=rows(ragged),
        data_collator=pad_rows,
        callbacks=list(callbacks),
    )
    trainer.train()
    return trainer


def test_the_trainer_passes_the_count_to_this_model_and_the_check_tells_it_is_ignored():
    trainer = Trainer(model=model(), args=TrainingArguments(output_dir="unused", **QUIET_CPU_RUN))
    assert trainer.model_accepts_loss_kwargs  # (its forward takes **kwargs)
    assert check_loss(model(), passes_items=True) == ModelLoss(shifts_labels=False, reads_items=False)
    assert check_loss(model(logits=False), passes_items=True).reads_items is False


@pytest.mark.parametrize("micro_batch_size", [1, 2, "auto"])
@pytest.mark.parametrize(
    "per_device, accumulation, ragged, logits",
    [
        pytest.param(8, 1, False, True, id="8x1"),
        pytest.param(4, 2, False, True, id="4x2"),
        pytest.param(8, 1, True, True, id="8x1-ragged"),
        pytest.param(4, 2, False, False, id="4x2-loss-alone"),
    ],
)
def test_a_mean_loss_has_the_plain_trainers_scale_whatever_the_cut(
    tmp_path, caplog, per_device, accumulation, ragged, logits, micro_batch_size
):
    split = dict(per_device=per_device, accumulation=accumulation, ragged=ragged, logits=logits)
    plain = train(tmp_path, [], **split)
    with caplog.at_level("WARNING", logger="adaptive_batch"):
        trainer = train(tmp_path, [AdaptiveBatch(micro_batch_size=micro_batch_size)], **split)
    assert logged(trainer, "adaptive_batch/effective_batch_size") == [8, 8]
    assert_close_parameters(parameters(trainer.model), parameters(plain.model), ORDER_TOLERANCE)
    # (the Trainer adds each micro-batch's loss to its float32 total: the logged loss is rounded to float32's)
    assert logged(trainer, "loss") == pytest.approx(logged(plain, "loss"), rel=1e-6)
    warnings = [r.getMessage() for r in caplog.records if "does not use num_items_in_batch" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].startswith(
        "AdaptiveBatch: The loss of TinyMeanLossModel does not use num_items_in_batch"
    )
