"""Offline helpers for tests, examples and trying a setup without a model hub or a GPU.

- `text_corpus()`: real English text from Python's own documentation (`pydoc_data.topics`), no download.
- `train_tokenizer(texts)`: a small byte-level BPE tokenizer trained on the spot.
- `tiny_llama(tokenizer)`: a randomly initialised Llama with a 64-wide hidden layer.
- `token_dataset(tokenizer, texts)`: tokenised rows of varying length, ready for a causal-LM collator.
- `FakeOutOfMemory`: makes a model raise the real `torch.OutOfMemoryError` above a number of rows (or tokens) per
  forward.
- `eval_pieces(trainer)`: the evaluation in pieces of a Trainer AdaptiveBatch is attached to, for tests to read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch


def text_corpus(min_chars: int = 40) -> list[str]:
    """Paragraphs of Python's documentation topics (shipped with CPython as `pydoc_data.topics`)."""
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics):
        for paragraph in re.split(r"\n\s*\n", topics[name]):
            text = " ".join(paragraph.split())
            if len(text) >= min_chars:
                paragraphs.append(text)
    return paragraphs


def train_tokenizer(texts: list[str], vocab_size: int = 512):
    """A byte-level BPE `PreTrainedTokenizerFast` trained on `texts`, with `<pad>` and `<eos>` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


def tiny_llama(tokenizer, hidden_size: int = 64, num_layers: int = 2, seed: int = 0, max_length: int = 512):
    """A random `LlamaForCausalLM` sized for CPU tests (about 100k parameters with a 512-token vocabulary)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_length,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.config.use_cache = False
    return model


def token_dataset(tokenizer, texts: list[str], max_length: int = 64) -> list[dict[str, list[int]]]:
    """Rows of `input_ids` (each text truncated to `max_length` tokens, ended by `<eos>`), of varying length."""
    rows = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: max_length - 1]
        rows.append({"input_ids": ids + [tokenizer.eos_token_id]})
    return rows


class FakeOutOfMemory:
    """Raise `torch.OutOfMemoryError` from a model's forward (or backward) when a micro-batch has too many rows or
    tokens.

    Args:
        model: the model to watch (any `nn.Module` called with `input_ids`).
        max_rows: the largest number of rows that "fits" (`None`: any).
        in_backward: raise during the backward pass instead of the forward.
        only_after_calls: let this many oversized forwards pass first (an OOM that appears late, e.g. after
            fragmentation).
        max_tokens: the largest number of tokens, rows x length as padded, that "fits" (`None`: any).
        times: raise at most this many times (`None`: every time): a transient error, such as one long step or a
            fragmented moment gives.
        in_eval: raise in forwards without gradients too (evaluation, prediction); by default only training's.

    Attributes:
        sizes: the rows of every forward the model was called with, in order (oversized ones included).
        tokens: the rows x length of every forward, in the same order.
        raised: the rows of every forward that raised.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        max_rows: int | None,
        in_backward: bool = False,
        only_after_calls: int = 0,
        max_tokens: int | None = None,
        times: int | None = None,
        in_eval: bool = False,
    ):
        self.max_rows = max_rows
        self.in_eval = in_eval
        self.times_left = times
        self.max_tokens = max_tokens
        self.in_backward = in_backward
        self.passes_left = only_after_calls
        self.sizes: list[int] = []
        self.tokens: list[int] = []
        self.raised: list[int] = []
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        rows, tokens = int(input_ids.shape[0]), input_ids.numel()
        self.sizes.append(rows)
        self.tokens.append(tokens)
        fits = (self.max_rows is None or rows <= self.max_rows) and (
            self.max_tokens is None or tokens <= self.max_tokens
        )
        if fits or not (torch.is_grad_enabled() or self.in_eval):
            return output
        if self.passes_left > 0:
            self.passes_left -= 1
            return output
        if self.times_left is not None:
            if self.times_left == 0:
                return output
            self.times_left -= 1
        self.raised.append(rows)
        if not self.in_backward:
            raise torch.OutOfMemoryError(f"CUDA out of memory (fake: {rows} rows of {tokens} tokens).")

        def explode(grad):
            raise torch.OutOfMemoryError(
                f"CUDA out of memory in backward (fake: {rows} rows of {tokens} tokens)."
            )

        values = (
            output.values()  # a model's output (a ModelOutput), or a layer's tuple, or a layer's tensor
            if isinstance(output, Mapping)
            else output
            if isinstance(output, tuple)
            else [output]
        )
        for value in values:  # the loss, logits or log-probabilities, whichever the backward starts from
            if isinstance(value, torch.Tensor) and value.requires_grad:
                value.register_hook(explode)
        return output

    def remove(self) -> None:
        self.handle.remove()


def eval_pieces(trainer):
    """The [`runtime.evaluation.EvalPieces`] that runs `trainer`'s eval batches under AdaptiveBatch (`None` where the
    Trainer's own evaluation runs): tests read its fitted `overhead` and its timed `points`, or set the overhead."""
    return trainer._adaptive_batch.assembly.eval_pieces


def example_model(model_dir: str | None, texts: list[str], vocab_size: int = 512, hidden_size: int = 64):
    """The examples' model and tokenizer: a local model folder (their `--model DIR`, e.g. for a GPU run) or, without
    one, a tiny random Llama with a tokenizer trained on `texts`. Returns `(tokenizer, make_model)`, where
    `make_model()` builds a fresh copy each call."""
    if model_dir is None:
        tokenizer = train_tokenizer(texts[:1500], vocab_size=vocab_size)
        return tokenizer, lambda: tiny_llama(tokenizer, hidden_size=hidden_size, num_layers=2)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:  # many causal LMs ship none; the collator pads with it
        tokenizer.pad_token = tokenizer.eos_token
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return tokenizer, lambda: AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)


def skip_deepspeed_shm_build() -> None:
    """Keep DeepSpeed from compiling its CPU shared-memory op (about 2 minutes of C++, used only by inference
    all-reduce, never in training) when it sets up communication on CPU processes. Through `importlib`:
    `import deepspeed.comm.torch` binds the real `torch` package, which `deepspeed.comm` re-exports."""
    import importlib

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
