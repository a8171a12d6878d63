"""Offline helpers for tests, examples and trying a setup without a model hub or a GPU: a text corpus, a tokenizer
trained on the spot, a tiny random Llama, and `FakeOutOfMemory`, which raises the real `torch.OutOfMemoryError`."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch


def text_corpus(min_chars: int = 40) -> list[str]:
    """Paragraphs of Python's documentation topics (shipped with CPython as `pydoc_data.topics`)."""
    from pydoc_data.topics import topics

    texts = (" ".join(part.split()) for name in sorted(topics) for part in re.split(r"\n\s*\n", topics[name]))
    return [text for text in texts if len(text) >= min_chars]


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
    ids = (tokenizer(text, add_special_tokens=False)["input_ids"][: max_length - 1] for text in texts)
    return [{"input_ids": row + [tokenizer.eos_token_id]} for row in ids]


class FakeOutOfMemory:
    """Raise `torch.OutOfMemoryError` from a model's forward (or backward, `in_backward`) above `max_rows` rows or
    `max_tokens` padded tokens (`None`: any), after `only_after_calls` oversized forwards, at most `times` times
    (`None`: every time), in evaluation too with `in_eval`."""

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
        self.max_rows, self.max_tokens, self.in_backward = max_rows, max_tokens, in_backward
        self.in_eval, self.times_left, self.passes_left = in_eval, times, only_after_calls
        self.sizes: list[int] = []  # the rows of every forward
        self.tokens: list[int] = []  # rows x length of every forward
        self.raised: list[int] = []  # the rows of every forward that raised
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        rows, tokens = int(input_ids.shape[0]), input_ids.numel()
        self.sizes.append(rows)
        self.tokens.append(tokens)
        fits = (self.max_rows is None or rows <= self.max_rows) and (
            self.max_tokens is None or tokens <= self.max_tokens
        )
        # (a training forward: with gradient, in train mode; the checks on the model run in eval mode)
        if fits or not (torch.is_grad_enabled() and module.training or self.in_eval):
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

        if isinstance(output, Mapping):  # a model's output (a ModelOutput); else a layer's tuple or tensor
            values = output.values()
        else:
            values = output if isinstance(output, tuple) else [output]
        for value in values:  # the loss, logits or log-probabilities, whichever the backward starts from
            if isinstance(value, torch.Tensor) and value.requires_grad:
                value.register_hook(explode)
        return output

    def remove(self) -> None:
        self.handle.remove()


def eval_growth(trainer):
    """The [`runtime.evaluation.EvalGrowth`] sizing `trainer`'s evaluations under `adapt_evaluation="grow"` (else `None`)."""
    return trainer._adaptive_batch.assembly.eval_growth


def example_model(model_dir: str | None, texts: list[str], vocab_size: int = 512, hidden_size: int = 64):
    """The examples' `(tokenizer, make_model)`: from a local model folder, or a tiny random Llama with a tokenizer
    trained on `texts`; `make_model()` builds a fresh copy each call."""
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
    """Keep DeepSpeed from compiling its CPU shared-memory op (2 minutes of C++, unused in training) on CPU
    processes. Through `importlib`: `import deepspeed.comm.torch` binds the `torch` `deepspeed.comm` re-exports."""
    import importlib

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
