"""Every task head the Trainer trains, trained with AdaptiveBatch as the plain Trainer trains it: one label per row
(sequence classification, multiple choice), per token (token classification, masked and causal LMs), per decoder
token (a seq2seq LM) or start and end positions (question answering).

Each head runs 2 steps of 8 rows with the ORDER_ONLY settings of helpers.py, cut into micro-batches of 1 and "auto",
against the plain Trainer's 8x1 on ragged rows from a padding collator and its 4x2 on rows of one length. The heads'
losses are transformers' own: most are their model's mean over the micro-batch whatever `num_items_in_batch` says,
so the plain Trainer's step sums its micro-batches' means, and a step cut otherwise must be weighted to that scale.
`max_grad_norm=0`: a gradient at the wrong scale shows in the update instead of being clipped to the same norm."""

from dataclasses import dataclass

import pytest
import torch
from helpers import (
    QUIET_CPU_RUN,
    assert_close_parameters,
    eval_pieces,
    keep_loss_in_float64,
    logged,
    parameters,
)
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForMultipleChoice,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    T5Config,
    T5ForConditionalGeneration,
    Trainer,
    TrainingArguments,
)

from adaptive_batch import AdaptiveBatch
from adaptive_batch.runtime.batch import StepBatch
from adaptive_batch.runtime.model_checks import ModelLoss, check_layout, check_loss

VOCAB = 64
ROWS = 16  # two steps of 8
CHOICES = 3


def no_zero_parameters(model: torch.nn.Module) -> torch.nn.Module:
    """float64, every parameter moved off its initial value by seeded noise: a bias that starts at zero and that the
    loss cannot move (a softmax's shift invariance: the key bias, a span head's) stays at rounding level, where a
    relative comparison of parameters measures nothing."""
    model = model.double()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
            parameter.add_(0.02 * noise)
    return model


def bert(head, **config):
    torch.manual_seed(0)
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return no_zero_parameters(head(BertConfig(**settings, **config)))


def llama(head, **config):
    torch.manual_seed(0)
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    return no_zero_parameters(head(LlamaConfig(**settings, **config)))


def t5():
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=VOCAB,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_heads=2,
        dropout_rate=0.0,
        pad_token_id=0,
        decoder_start_token_id=0,
    )
    return no_zero_parameters(T5ForConditionalGeneration(config))


def causal_lm():
    return keep_loss_in_float64(llama(LlamaForCausalLM))


def tokens(row: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(row)
    return torch.randint(1, VOCAB, (length,), generator=generator).tolist()


def length_of(row: int, ragged: bool) -> int:
    return 3 + (5 * row) % 9 if ragged else 8  # 3 to 11 tokens, or 8


@dataclass(frozen=True)
class Head:
    model: object  # () -> the model
    sample: object  # (row, ragged) -> one sample of the dataset


def sequence_label(row, ragged):
    return {"input_ids": tokens(row, length_of(row, ragged)), "labels": row % 3}


def token_labels(row, ragged):
    ids = tokens(row, length_of(row, ragged))
    return {"input_ids": ids, "labels": [token % 3 for token in ids]}


def span(row, ragged):
    length = length_of(row, ragged)
    return {
        "input_ids": tokens(row, length),
        "start_positions": row % length,
        "end_positions": (row + 1) % length,
    }


def choices(row, ragged):
    # (rows of one length: the choices of a row are padded to one length by its collator, not ragged across rows)
    return {"input_ids": [tokens(CHOICES * row + c, 6) for c in range(CHOICES)], "labels": row % CHOICES}


def masked(row, ragged):
    ids = tokens(row, length_of(row, ragged))
    return {"input_ids": ids, "labels": [t if i % 3 == 0 else -100 for i, t in enumerate(ids)]}


def next_tokens(row, ragged):
    ids = tokens(row, length_of(row, ragged))
    return {"input_ids": ids, "labels": ids}


def translation(row, ragged):
    ids = tokens(row, length_of(row, ragged))
    return {
        "input_ids": ids,
        "labels": ids[::-1][: max(2, len(ids) - 2)],
    }  # decoder labels of their own length


HEADS = {
    "sequence classification": Head(
        lambda: bert(BertForSequenceClassification, num_labels=3), sequence_label
    ),
    "sequence classification, decoder": Head(
        lambda: llama(LlamaForSequenceClassification, num_labels=3), sequence_label
    ),
    "token classification": Head(lambda: bert(BertForTokenClassification, num_labels=3), token_labels),
    "question answering": Head(lambda: bert(BertForQuestionAnswering), span),
    "multiple choice": Head(lambda: bert(BertForMultipleChoice), choices),
    "masked LM": Head(lambda: bert(BertForMaskedLM), masked),
    "causal LM": Head(causal_lm, next_tokens),
    "seq2seq LM": Head(t5, translation),
}


def pad_rows(samples: list[dict]) -> dict:
    """A padding collator: per-token lists right-padded (`input_ids` with 0 and an `attention_mask`, `labels` with
    -100), per-row values (a label, a position, a row's choices of one length) stacked."""
    batch = {}
    for key in samples[0]:
        values = [sample[key] for sample in samples]
        if isinstance(values[0], list) and not isinstance(values[0][0], list):
            width = max(len(value) for value in values)
            fill = -100 if key == "labels" else 0
            batch[key] = torch.tensor([value + [fill] * (width - len(value)) for value in values])
            if key == "input_ids":
                batch["attention_mask"] = torch.tensor(
                    [[1] * len(value) + [0] * (width - len(value)) for value in values]
                )
        else:
            batch[key] = torch.tensor(values)
    return batch


def train(head: Head, callbacks, tmp_path, ragged: bool, per_device: int = 8, accumulation: int = 1):
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        num_train_epochs=1,
        optim="sgd",
        learning_rate=0.1,
        max_grad_norm=0.0,
        **QUIET_CPU_RUN,
    )
    dataset = [head.sample(row, ragged) for row in range(ROWS)]
    trainer = Trainer(
        model=head.model(),
        args=args,
        train_dataset=dataset,
        data_collator=pad_rows,
        callbacks=list(callbacks),
    )
    trainer.train()
    return trainer


PLAIN = [
    pytest.param(True, 8, 1, id="ragged-8x1"),
    pytest.param(False, 4, 2, id="one-length-4x2"),
]


@pytest.mark.parametrize("micro_batch_size", [1, "auto"])
@pytest.mark.parametrize("ragged, per_device, accumulation", PLAIN)
@pytest.mark.parametrize("name", list(HEADS))
def test_every_head_trains_as_the_plain_trainer_trains_it(
    tmp_path, name, ragged, per_device, accumulation, micro_batch_size
):
    head = HEADS[name]
    if ragged and name == "multiple choice":
        pytest.skip("a multiple-choice row's choices are of one length")
    split = dict(ragged=ragged, per_device=per_device, accumulation=accumulation)
    plain = train(head, [], tmp_path, **split)
    adaptive = AdaptiveBatch(micro_batch_size=micro_batch_size)
    trainer = train(head, [adaptive], tmp_path, **split)
    assert logged(trainer, "adaptive_batch/effective_batch_size") == [8, 8]
    if micro_batch_size == 1:
        assert logged(trainer, "adaptive_batch/accumulation_steps") == [8, 8]
    assert_close_parameters(parameters(trainer.model), parameters(plain.model))
    # (the Trainer adds each micro-batch's loss to its float32 total: the logged loss is rounded to float32's)
    assert logged(trainer, "loss") == pytest.approx(logged(plain, "loss"), rel=1e-6)


def test_ragged_rows_with_one_label_each_are_cut_by_rows_with_their_padding():
    samples = [sequence_label(row, ragged=True) for row in range(8)]
    batch = pad_rows(samples)
    step = StepBatch(batch)  # (trims=True: as before a check on the model says otherwise)
    assert not step.trimmable  # a label per row was not shown to allow cutting the row's padding
    chunk = step.take(0, 2)
    assert chunk["input_ids"].shape == (2, batch["input_ids"].shape[1]) and chunk["labels"].shape == (2,)
    assert step.label_counts(shifted=True).tolist() == [1] * 8  # one label each, never shifted
    ignored = dict(batch, labels=batch["labels"].masked_fill(torch.arange(8) == 3, -100))
    assert StepBatch(ignored).label_counts(shifted=False).tolist() == [1, 1, 1, 0, 1, 1, 1, 1]


def test_a_span_heads_positions_keep_the_row_at_its_width():
    # a start or end position indexes the row's width, padding included: a trimmed row would score another softmax
    batch = pad_rows([span(row, ragged=True) for row in range(8)])
    step = StepBatch(batch)
    assert not step.trimmable
    assert step.take(0, 3)["input_ids"].shape[1] == batch["input_ids"].shape[1]


def test_a_span_heads_eval_batches_are_not_cut_short_of_their_padding(tmp_path):
    # grown evaluation groups a ragged batch's rows by length, each group at its own width; a span head's softmax
    # runs over the row's width, padding included, so its loss would change: its batches run whole
    def evaluate(callbacks):
        args = TrainingArguments(
            output_dir=str(tmp_path / "out"), per_device_eval_batch_size=8, **QUIET_CPU_RUN
        )
        dataset = [span(row, ragged=True) for row in range(16)]
        model = HEADS["question answering"].model()
        trainer = Trainer(
            model=model, args=args, eval_dataset=dataset, data_collator=pad_rows, callbacks=callbacks
        )
        if (
            callbacks
        ):  # (a forward's fixed time, as fitted from earlier forwards' times: rows of other lengths pay)
            eval_pieces(trainer).overhead = 2
        return trainer.evaluate()

    plain = evaluate([])
    metrics = evaluate([AdaptiveBatch(adapt_evaluation="grow")])
    assert metrics["eval_adaptive_batch/batches_cut_by_tokens"] == 0
    assert metrics["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-12)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("sequence classification", ModelLoss(shifts_labels=None, reads_items=False)),
        ("sequence classification, decoder", ModelLoss(shifts_labels=None, reads_items=False)),
        ("token classification", ModelLoss(shifts_labels=False, reads_items=False)),
        ("multiple choice", ModelLoss(shifts_labels=None, reads_items=False)),
        ("masked LM", ModelLoss(shifts_labels=False, reads_items=False)),
        ("causal LM", ModelLoss(shifts_labels=True, reads_items=True)),
        ("seq2seq LM", ModelLoss(shifts_labels=False, reads_items=False)),
    ],
)
def test_the_loss_check_tells_each_heads_divisor(name, expected):
    model = HEADS[name].model()
    problem_type = model.config.problem_type
    assert check_loss(model, passes_items=True) == expected
    # a classifier's forward sets config.problem_type from the first labels it sees: the check's must not decide it
    assert model.config.problem_type == problem_type


def test_a_head_without_a_logit_per_token_is_not_laid_out_and_the_check_says_why():
    verdict = check_layout(HEADS["sequence classification"].model(), "trimmed")
    assert not verdict.exact
    assert verdict.error == "its output is not one logit vector per token ([4, 3] for inputs [4, 35])"


def test_token_classification_is_shown_exact_cut_short_of_its_padding():
    verdict = check_layout(HEADS["token classification"].model(), "trimmed")
    assert verdict.exact, verdict.text()


def test_a_regression_head_keeps_its_problem_type_unset_and_its_loss_told():
    model = bert(BertForSequenceClassification, num_labels=1)
    assert check_loss(model, passes_items=True) == ModelLoss(shifts_labels=None, reads_items=False)
    assert model.config.problem_type is None
