"""What `adaptive-batch plan` needs of a dataset file: its rows and, where they can be counted, its tokens."""

from __future__ import annotations

import json
from pathlib import Path

from ..runtime import lengths


def dataset_facts(path: Path, tokenizer_dir: Path | None = None) -> tuple[int, int | None]:
    """(rows, tokens per epoch or `None`) of a .jsonl/.json file or a `datasets.save_to_disk` folder.

    Tokens are read from the rows' `input_ids`; without them, counted with the tokenizer in `tokenizer_dir` from
    rows holding 'text' or 'messages'; else not known (`None`).
    """
    if not path.exists():
        raise ValueError(
            f"--dataset {path} does not exist; pass a .jsonl/.json file or a save_to_disk folder."
        )
    if path.is_dir():
        return _saved_dataset_facts(path, tokenizer_dir)
    records = _read_records(path)
    if not records:
        raise ValueError(f"--dataset {path} holds no records.")
    with_ids = [
        r["input_ids"] for r in records if isinstance(r, dict) and isinstance(r.get("input_ids"), list)
    ]
    if len(with_ids) == len(records):
        return len(records), sum(map(len, with_ids))
    if tokenizer_dir is not None:
        return len(records), _count_tokens(records, tokenizer_dir, path)
    return len(records), None


def _saved_dataset_facts(path: Path, tokenizer_dir: Path | None) -> tuple[int, int | None]:
    from datasets import load_from_disk

    dataset = load_from_disk(str(path))
    if hasattr(dataset, "keys"):
        if "train" not in dataset:
            raise ValueError(f"--dataset {path} is a DatasetDict without a 'train' split: {sorted(dataset)}.")
        dataset = dataset["train"]
    tokens = lengths.total_tokens(dataset)
    if tokens is None and tokenizer_dir is not None:
        tokens = _count_tokens(dataset, tokenizer_dir, path)
    return len(dataset), tokens


def _count_tokens(rows, tokenizer_dir: Path, path: Path) -> int:
    """Tokens of rows holding 'text' (tokenized as is) or 'messages' (the tokenizer's chat template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    total = 0
    for index, row in enumerate(rows):
        if isinstance(row, dict) and isinstance(row.get("text"), str):
            total += len(tokenizer(row["text"])["input_ids"])
        elif isinstance(row, dict) and isinstance(row.get("messages"), list):
            total += _chat_tokens(tokenizer, row["messages"], path, index)
        else:
            raise ValueError(
                f"--dataset {path} row {index} holds neither 'input_ids', 'text' nor 'messages', so --tokenizer "
                "has nothing to count; pass a dataset of those, or leave --tokenizer out (tokens unknown)."
            )
    return total


def _chat_tokens(tokenizer, messages: list, path: Path, index: int) -> int:
    """Tokens of one conversation as the Trainer (or TRL) trains on it: the chat template's text, tokenized without
    adding special tokens again (the template writes its own). Not `len(apply_chat_template(tokenize=True))`: in
    transformers 5 that returns a `BatchEncoding`, whose `len()` is its number of keys."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"--dataset {path} row {index} holds 'messages' but the --tokenizer has no chat_template to render them "
            "with; pass the tokenizer folder of a chat model (its tokenizer_config.json or chat_template.jinja holds "
            "one), or rows of 'text' / 'input_ids'."
        )
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _read_records(path: Path) -> list:
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
        return data if isinstance(data, list) else data.get("data", [])
    return [json.loads(line) for line in text.splitlines() if line.strip()]
