"""A dataset file's rows and tokens as the run trains on them, for `adaptive-batch plan`: prepared by the installed
TRL's `SFTTrainer._prepare_dataset` for an SFTTrainer run. See docs/how-it-works.md, "The commands"."""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

from ..runtime import lengths
from ..runtime.compat.trl import sft_prepare_dataset
from .sft_args import SFTArgs


@dataclasses.dataclass
class DatasetFacts:
    """The rows trained on per epoch, their tokens (`None`: unknown), how they were counted, settings not followed."""

    rows: int
    tokens: int | None
    notes: list = dataclasses.field(default_factory=list)
    not_used: list = dataclasses.field(default_factory=list)


def dataset_facts(path: Path, tokenizer_dir: Path | None, sft: SFTArgs) -> DatasetFacts:
    """The rows and tokens per epoch of a .jsonl/.json file or a `save_to_disk` folder, as the run trains on them."""
    if not path.exists():
        raise ValueError(
            f"--dataset {path} does not exist; pass a .jsonl/.json file or a save_to_disk folder."
        )
    rows = _load(path)
    if len(rows) == 0:
        raise ValueError(f"--dataset {path} holds no records.")
    if hasattr(rows, "column_names"):
        tokenized = "input_ids" in rows.column_names
    else:
        tokenized = all(isinstance(row, dict) and isinstance(row.get("input_ids"), list) for row in rows)
    given = sft.changed()
    if tokenized and not sft.is_sft:
        return DatasetFacts(len(rows), lengths.total_tokens(rows))
    facts = DatasetFacts(len(rows), None)
    # no TRL: counted as the rows are (text through the tokenizer, chat through its template)
    if sft.defaults is None:
        if tokenized:
            facts.tokens = lengths.total_tokens(rows)
        elif tokenizer_dir is not None:
            facts.tokens = _count_tokens(rows, tokenizer_dir, path)
            facts.notes.append(
                "TRL is not installed: tokens counted without SFTTrainer's preparation (its EOS, truncation, packing)"
            )
        if given:
            facts.not_used.append(f"{given}: TRL is not installed to prepare the dataset with them")
        return facts
    if not tokenized and tokenizer_dir is None:
        if given:
            facts.not_used.append(
                f"{given}: the rows are not tokenised without --tokenizer, so their rows and tokens are the "
                "file's, not SFTTrainer's; pass --tokenizer to prepare them as SFTTrainer does"
            )
        return facts
    return _sft_facts(facts, rows, tokenized, path, tokenizer_dir, sft)


def _sft_facts(facts, rows, tokenized: bool, path: Path, tokenizer_dir, sft: SFTArgs):
    """Rows and tokens as the installed TRL's SFTTrainer prepares `rows`: `_prepare_dataset` run to tokenise alone (the
    tokens before truncation), then on those rows with the run's truncation, packing and shuffle, as in one call."""
    import datasets
    import trl
    from trl.data_utils import is_conversational

    args = sft.config()
    template = args.chat_template_path
    if template is not None and not str(template).endswith((".jinja", ".j2")):
        facts.not_used.append(
            f"chat_template_path={template!r}: SFTTrainer clones that tokenizer's template and special tokens into "
            "the model; plan renders with --tokenizer's own template, so pass --tokenizer a folder that holds it"
        )
    if (eval_packing := sft.eval_only.get("eval_packing")) not in (None, "None", "none"):
        facts.not_used.append(
            f"eval_packing={eval_packing!r}: the eval set's, and plan counts the train set only"
        )
    if sft.hidden_eos_token and not (tokenized or is_conversational(rows[0])):
        facts.not_used.append(
            f"eos_token: {sft.hidden_eos_token} hides it (to_json_string writes '<EOS_TOKEN>'), so the EOS added to "
            "each text row is --tokenizer's own; pass -- --eos_token TOKEN where the run sets one"
        )
    if (args.dataset_kwargs or {}).get("skip_prepare_dataset", False):
        facts.tokens = lengths.total_tokens(rows) if tokenized else None
        facts.notes.append(
            "dataset_kwargs skip_prepare_dataset=True: SFTTrainer trains on the rows as they are"
        )
        return facts
    dataset = rows if isinstance(rows, datasets.Dataset) else datasets.Dataset.from_list(rows)
    first = dataset[0]
    if "image" in first or "images" in first:
        facts.notes.append(
            "rows with images: SFTTrainer prepares them while training, so their tokens are not known"
        )
        return facts
    tokenizer = None if tokenizer_dir is None else _tokenizer(tokenizer_dir, args)  # None: rows tokenised
    _check_first_row(first, tokenizer, args, path)
    padding_free = args.padding_free or (args.packing and args.packing_strategy in {"bfd", "bfd_split"})
    if padding_free and not args.packing and args.max_length is not None:
        raise ValueError(
            f"padding_free=True without packing and with max_length={args.max_length}: SFTTrainer refuses it "
            "(max_length is not enforced padding-free); enable packing, or set max_length None."
        )
    if args.packing and args.max_length is None:
        raise ValueError(
            "packing=True needs a max_length (SFTTrainer refuses None); set e.g. --max_length 1024."
        )
    chat_template = None
    if args.assistant_only_loss:
        from trl.chat_template_utils import get_training_chat_template, has_generation_markers

        if not is_conversational(first):
            raise ValueError(
                "assistant_only_loss=True needs conversational rows ('messages'); SFTTrainer refuses --dataset's."
            )
        if not has_generation_markers(tokenizer.chat_template):
            chat_template = get_training_chat_template(tokenizer)
    completion_only_loss = args.completion_only_loss
    if completion_only_loss is None:
        completion_only_loss = "prompt" in first and "completion" in first
    tokenize_only = types.SimpleNamespace(
        **{**vars(args), "max_length": None, "packing": False, "shuffle_dataset": False}
    )
    was_quiet = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # (they are not the plan's output)
    try:
        prepared = sft_prepare_dataset(
            dataset, tokenizer, tokenize_only, False, chat_template, completion_only_loss
        )
        before = _row_lengths(prepared)
        prepared = sft_prepare_dataset(
            prepared, tokenizer, args, args.packing, chat_template, completion_only_loss
        )
        after = _row_lengths(prepared)
    except (AttributeError, TypeError) as error:
        raise ValueError(
            f"TRL {trl.__version__}'s SFTTrainer._prepare_dataset could not be run as plan runs it ({error}); "
            "plan follows TRL 1.16's preparation."
        ) from None
    except (KeyError, RuntimeError) as error:
        raise ValueError(f"SFTTrainer's preparation of --dataset {path} fails: {error!r}.") from None
    finally:
        if not was_quiet:
            datasets.enable_progress_bars()
    facts.rows, facts.tokens = len(after), sum(after)
    facts.notes.append(_how(args, sft, before, after, trl.__version__))
    return facts


def _how(args, sft: SFTArgs, before: list[int], after: list[int], version: str) -> str:
    """One line on how TRL's preparation gave the rows and tokens."""

    def setting(name):
        origin = "" if name in sft.given else " (SFTConfig's default)"
        return f"{name}={getattr(args, name)!r}{origin}"

    text = f"rows and tokens as TRL {version}'s SFTTrainer prepares --dataset: "
    tokens_before, tokens_after = sum(before), sum(after)
    if args.packing:
        text += (
            f"packing ({setting('packing_strategy')}, {setting('max_length')}) packs {len(before):,} rows of "
            f"{tokens_before:,} tokens into {len(after):,} rows of {tokens_after:,} tokens"
        )
    elif args.max_length is None:
        text += f"max_length=None{' (given)' if 'max_length' in sft.given else ''}: no truncation"
    else:
        cut = sum(length > args.max_length for length in before)
        text += f"{setting('max_length')} truncates {cut:,} of {len(before):,} rows"
        if cut:
            text += f" ({tokens_before:,} -> {tokens_after:,} tokens)"
        if len(after) < len(before):
            text += f", and drops {len(before) - len(after):,} left with no token in the loss"
    return text


def _tokenizer(tokenizer_dir: Path, args):
    """The --tokenizer as SFTTrainer sets it up: its eos_token, a .jinja chat_template_path."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if args.eos_token is not None:
        if args.eos_token not in tokenizer.get_vocab():
            raise ValueError(
                f"eos_token={args.eos_token!r} is not in --tokenizer {tokenizer_dir}'s vocabulary; SFTTrainer refuses it."
            )
        tokenizer.eos_token = args.eos_token
    template = args.chat_template_path
    if template is not None and str(template).endswith((".jinja", ".j2")) and Path(template).is_file():
        tokenizer.chat_template = Path(template).read_text(encoding="utf-8")
    return tokenizer


def _check_first_row(first: dict, tokenizer, args, path: Path) -> None:
    """Refuse, naming what is missing, a dataset whose first row (the one SFTTrainer looks at) it cannot prepare."""
    from trl.data_utils import is_conversational, is_conversational_from_value

    if "input_ids" in first:
        return
    if is_conversational(first) or is_conversational_from_value(first):
        _check_chat_template(tokenizer, path, 0)
    elif args.dataset_text_field not in first and not ("prompt" in first and "completion" in first):
        raise ValueError(
            f"--dataset {path} row 0 holds neither 'input_ids', {args.dataset_text_field!r} (dataset_text_field), "
            "'messages' nor 'prompt' and 'completion', so SFTTrainer has nothing to tokenise (a formatting_func "
            "of the script's is not seen by plan); pass a dataset of those, or leave --tokenizer out (tokens unknown)."
        )


def _row_lengths(dataset) -> list[int]:
    """Each row's number of input_ids, reading the dataset through its indices (a shuffle or filter leaves one)."""
    return lengths.row_lengths(dataset.select_columns(["input_ids"]).flatten_indices())


def _load(path: Path):
    """The records of a .jsonl/.json file (a list of dicts), or the train split of a save_to_disk folder."""
    if path.is_dir():
        from datasets import load_from_disk

        dataset = load_from_disk(str(path))
        if hasattr(dataset, "keys"):
            if "train" not in dataset:
                raise ValueError(
                    f"--dataset {path} is a DatasetDict without a 'train' split: {sorted(dataset)}."
                )
            dataset = dataset["train"]
        return dataset
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
        return data if isinstance(data, list) else data.get("data", [])
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _count_tokens(rows, tokenizer_dir: Path, path: Path) -> int:
    """Without TRL: tokens of rows holding 'text' (tokenized as is) or 'messages' (the tokenizer's chat template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    total = 0
    for index, row in enumerate(rows):
        if isinstance(row, dict) and isinstance(row.get("text"), str):
            total += len(tokenizer(row["text"])["input_ids"])
        elif isinstance(row, dict) and isinstance(row.get("messages"), list):
            # the template's text tokenized without adding special tokens again (the template writes its own); not
            # len(apply_chat_template(tokenize=True)): in transformers 5 that is a BatchEncoding's number of keys
            _check_chat_template(tokenizer, path, index)
            text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
            total += len(tokenizer(text, add_special_tokens=False)["input_ids"])
        else:
            raise ValueError(
                f"--dataset {path} row {index} holds neither 'input_ids', 'text' nor 'messages', so --tokenizer "
                "has nothing to count; pass a dataset of those, or leave --tokenizer out (tokens unknown)."
            )
    return total


def _check_chat_template(tokenizer, path: Path, index: int) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"--dataset {path} row {index} holds 'messages' but the --tokenizer has no chat_template to render them "
            "with; pass the tokenizer folder of a chat model (its tokenizer_config.json or chat_template.jinja holds "
            "one), or rows of 'text' / 'input_ids'."
        )
