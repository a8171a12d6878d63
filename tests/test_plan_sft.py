"""`adaptive-batch plan` counts the rows and tokens an SFTTrainer run trains on: a chat JSONL prepared as TRL prepares
it (chat template, truncation at max_length, packing), with the SFTConfig fields read from the script's arguments
after -- or from a saved training_args.bin. Each count is checked against a real SFTTrainer (a tiny random Llama on
the CPU): its prepared train_dataset, the non-padding tokens of the batches its dataloader yields, and the optimizer
steps of its epoch."""

import dataclasses
import json

import pytest
import torch

trl = pytest.importorskip("trl")
from helpers import QUIET_CPU_RUN  # noqa: E402

from adaptive_batch.cli.main import main  # noqa: E402
from adaptive_batch.testing import tiny_llama  # noqa: E402

MAX_LENGTH = 128
PACKED_LENGTH = 320  # packed rows long enough to hold several conversations
PER_DEVICE = 4
TEMPLATE = "{% for m in messages %}<eos>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory, tokenizer):
    """The test tokenizer with a chat template, saved as a chat model's tokenizer folder."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("chat-tokenizer")
    tokenizer.save_pretrained(folder)
    chat = AutoTokenizer.from_pretrained(folder)
    chat.chat_template = TEMPLATE
    chat.save_pretrained(folder)
    return folder, AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def chat_jsonl(tmp_path_factory, texts):
    """120 conversations of 60 to 410 characters an answer: some longer than MAX_LENGTH tokens, some not."""
    conversations = []
    for i in range(120):
        question, answer = texts[i][:120], texts[300 + i][: 60 + (i % 6) * 70]
        conversations.append(
            {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
        )
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in conversations))
    return path


def sft_trainer(chat_tokenizer, chat_jsonl, tmp_path, **config):
    """The SFTTrainer of a script that loads the JSONL with `load_dataset` and trains a tiny Llama on it."""
    from datasets import load_dataset

    _, tokenizer = chat_tokenizer
    dataset = load_dataset(
        "json", data_files=str(chat_jsonl), split="train", cache_dir=str(tmp_path / "cache")
    )
    settings = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=PER_DEVICE,
        num_train_epochs=1,
        max_length=MAX_LENGTH,
        bf16=False,
        **QUIET_CPU_RUN,
    )
    # SFTConfig turns it on by default; transformers 5.24 calls it activation_checkpointing, 5.17 gradient_...
    fields = {f.name for f in dataclasses.fields(trl.SFTConfig)}
    settings[
        "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    ] = False
    settings.update(config)
    return trl.SFTTrainer(
        model=tiny_llama(tokenizer, max_length=2 * MAX_LENGTH),
        args=trl.SFTConfig(**settings),
        train_dataset=dataset,
        processing_class=tokenizer,
    )


def trained_on(trainer) -> tuple[int, int]:
    """(rows, tokens) of one epoch as the trainer sees it: its prepared train_dataset's rows, and the non-padding
    tokens of the batches its dataloader yields (padded batches: the attention mask's ones; padding-free batches,
    one flat row of every sequence: all their tokens)."""
    tokens = 0
    for batch in trainer.get_train_dataloader():
        if "attention_mask" in batch:
            tokens += int(batch["attention_mask"].sum())
        else:
            tokens += batch["input_ids"].numel()
    dataset_tokens = sum(len(ids) for ids in trainer.train_dataset["input_ids"])
    assert tokens == dataset_tokens  # the dataloader drops or pads none of the dataset's tokens
    return len(trainer.train_dataset), tokens


def plan(capsys, *argv) -> tuple[dict, str]:
    capsys.readouterr()
    code = main(["plan", "--json", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out), err


def plan_sft(capsys, chat_tokenizer, chat_jsonl, *argv) -> tuple[dict, str]:
    folder, _ = chat_tokenizer
    return plan(capsys, "--dataset", str(chat_jsonl), "--tokenizer", str(folder), "--epochs", "1", *argv)


@pytest.mark.parametrize("given_by", ["script", "training_args.bin"])
def test_plan_counts_the_rows_and_tokens_sft_truncation_leaves(
    capsys, tmp_path, chat_tokenizer, chat_jsonl, given_by
):
    trainer = sft_trainer(chat_tokenizer, chat_jsonl, tmp_path)
    rows, tokens = trained_on(trainer)
    _, tokenizer = chat_tokenizer
    full = [
        len(tokenizer.apply_chat_template(json.loads(line)["messages"], return_dict=True)["input_ids"])
        for line in open(chat_jsonl)
    ]
    cut = sum(length > MAX_LENGTH for length in full)
    assert 0 < cut < len(full) and tokens < sum(full)  # the data is truncated, not all of it
    if given_by == "script":
        argv = ["--", "--max_length", str(MAX_LENGTH), "--per_device_train_batch_size", str(PER_DEVICE)]
    else:
        torch.save(trainer.args, tmp_path / "training_args.bin")
        argv = ["--args", str(tmp_path / "training_args.bin")]
    result, _ = plan_sft(capsys, chat_tokenizer, chat_jsonl, *argv)
    assert (result["dataset_size"], result["tokens"]) == (rows, tokens)
    (note,) = result["dataset_notes"]
    assert (
        f"max_length={MAX_LENGTH!r} truncates {cut} of {len(full)} rows ({sum(full):,} -> {tokens:,} tokens)"
        in note
    )
    assert result["not_used"] == []
    assert result["optimizer_steps"] == len(
        trainer.get_train_dataloader()
    )  # the trainer's steps of one epoch


def test_without_sft_fields_plan_prepares_as_sft_config_s_defaults(
    capsys, tmp_path, chat_tokenizer, chat_jsonl
):
    """Chat rows are tokenised only by SFTTrainer: without a field given, its defaults (max_length 1024) apply."""
    trainer = sft_trainer(chat_tokenizer, chat_jsonl, tmp_path, max_length=1024)
    result, _ = plan_sft(capsys, chat_tokenizer, chat_jsonl)
    assert (result["dataset_size"], result["tokens"]) == trained_on(trainer)
    assert result["dataset_notes"] == [
        "rows and tokens as TRL 1.16.0's SFTTrainer prepares --dataset: max_length=1024 (SFTConfig's default) "
        "truncates 0 of 120 rows"
    ]


@pytest.mark.parametrize("strategy", ["bfd", "wrapped"])
def test_plan_counts_the_packed_rows_and_their_tokens(capsys, tmp_path, chat_tokenizer, chat_jsonl, strategy):
    config = dict(packing=True, packing_strategy=strategy, max_length=PACKED_LENGTH)
    trainer = sft_trainer(chat_tokenizer, chat_jsonl, tmp_path, **config)
    rows, tokens = trained_on(trainer)
    assert rows < 120  # packed: fewer rows than conversations
    argv = ["--max_length", str(PACKED_LENGTH), "--packing", "--packing_strategy", strategy]
    result, _ = plan_sft(capsys, chat_tokenizer, chat_jsonl, "--per-device", str(PER_DEVICE), "--", *argv)
    assert (result["dataset_size"], result["tokens"]) == (rows, tokens)
    (note,) = result["dataset_notes"]
    assert "packs 120 rows of" in note and f"into {rows} rows of {tokens:,} tokens" in note
    torch.save(trainer.args, tmp_path / "training_args.bin")
    result, _ = plan_sft(capsys, chat_tokenizer, chat_jsonl, "--args", str(tmp_path / "training_args.bin"))
    assert (result["dataset_size"], result["tokens"]) == (rows, tokens)
    assert result["optimizer_steps"] == len(
        trainer.get_train_dataloader()
    )  # the trainer's steps of one epoch


def test_fields_and_options_plan_cannot_use_are_named_one_line_each(capsys, chat_tokenizer, chat_jsonl):
    argv = ["--", "--model_name_or_path", "m", "--max_length", "128", "--eval_packing", "--dataset-name=x"]
    argv += ["--chat_template_path", "some/model"]
    result, _ = plan_sft(capsys, chat_tokenizer, chat_jsonl, *argv)
    unknown, template, eval_packing = result["not_used"]
    assert unknown.startswith("--model_name_or_path, --dataset-name after --: no field of SFTConfig")
    assert template.startswith("chat_template_path='some/model': SFTTrainer clones")
    assert eval_packing.startswith("eval_packing='true': the eval set's")
    capsys.readouterr()
    assert main(["plan", "--dataset", str(chat_jsonl), "--tokenizer", str(chat_tokenizer[0]), *argv]) == 0
    err = capsys.readouterr().err  # the table's run prints each line on stderr
    assert all(f"not used: {line}\n" in err for line in result["not_used"])
    result, _ = plan(capsys, "--dataset-size", "100", "--", "--max_length", "128", "--packing")
    (line,) = result["not_used"]
    assert line.startswith(
        "max_length=128, packing=True: they change the rows or tokens SFTTrainer trains on"
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--packing", "maybe"],
            "the script arguments after -- give packing='maybe', which is not true or false",
        ),
        (["--max_length", "0"], "give max_length='0', which is not a positive int or None"),
        (
            ["--packing_strategy", "best"],
            "packing_strategy='best', which is not 'bfd', 'bfd_split' or 'wrapped'",
        ),
        (
            ["--padding_free", "--max_length", "64"],
            "padding_free=True without packing and with max_length=64",
        ),
    ],
)
def test_bad_sft_fields_are_refused_naming_the_field(capsys, chat_tokenizer, chat_jsonl, argv, message):
    folder, _ = chat_tokenizer
    code = main(["plan", "--dataset", str(chat_jsonl), "--tokenizer", str(folder), "--", *argv])
    _, err = capsys.readouterr()
    assert code == 1 and message in err and err.count("\n") == 1


def test_rows_truncation_leaves_without_a_loss_token_are_dropped_as_sft_trainer_drops_them(
    capsys, tmp_path, chat_tokenizer, texts
):
    """Prompt-completion rows train on the completion only: a prompt that fills max_length leaves no token in the
    loss, and SFTTrainer drops the row; plan's rows drop with it."""
    rows = [{"prompt": texts[i][: 40 + (i % 4) * 150], "completion": texts[200 + i][:80]} for i in range(40)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    trainer = sft_trainer(chat_tokenizer, path, tmp_path, max_length=64)
    trained_rows, tokens = trained_on(trainer)
    assert 0 < trained_rows < 40  # some rows dropped, not all
    result, _ = plan_sft(capsys, chat_tokenizer, path, "--", "--max_length", "64")
    assert (result["dataset_size"], result["tokens"]) == (trained_rows, tokens)
    assert f"and drops {40 - trained_rows} left with no token in the loss" in result["dataset_notes"][0]
