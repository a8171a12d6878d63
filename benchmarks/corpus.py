"""An offline corpus for training from scratch: the Python source of installed packages, tokenised.

No dataset hub is reachable, and the GPU machine's own standard library holds only about 2.7M tokens of source, so
the corpus is built here and carried: every `.py` file under the given directories (sorted by path, so the corpus
is the same on any machine with the same packages), a byte-level BPE tokenizer trained on the first part of it,
and the token ids of files joined by `<eos>`, as uint16, in one compressed `.npz` with the tokenizer beside it.

    python benchmarks/corpus.py --out .corpus --tokens 24000000 .venv/lib/python3.11/site-packages
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

import numpy as np


def source_files(roots: list[str]) -> list[Path]:
    files = []
    for root in roots:
        files.extend(sorted(Path(root).rglob("*.py")))
    return files


def texts(files: list[Path], min_chars: int = 200):
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) >= min_chars:
            yield text


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="+", help="directories whose .py files make the corpus")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=24_000_000, help="stop after this many tokens")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--tokenizer-chars", type=int, default=20_000_000, help="characters to train BPE on")
    options = parser.parse_args()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = source_files(options.roots)
    sample, chars = [], 0
    for text in texts(files):
        sample.append(text)
        chars += len(text)
        if chars >= options.tokenizer_chars:
            break
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=options.vocab,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(sample, trainer=trainer)
    eos = tokenizer.token_to_id("<eos>")
    ids: list[np.ndarray] = []
    count = used = 0
    for text in texts(files):
        encoded = np.asarray(tokenizer.encode(text).ids + [eos], dtype=np.uint16)
        ids.append(encoded)
        count += len(encoded)
        used += 1
        if count >= options.tokens:
            break
    tokens = np.concatenate(ids)[: options.tokens]
    os.makedirs(options.out, exist_ok=True)
    np.savez_compressed(os.path.join(options.out, "tokens.npz"), tokens=tokens)
    tokenizer.save(os.path.join(options.out, "tokenizer.json"))
    digest = hashlib.sha256(tokens.tobytes()).hexdigest()
    info = {
        "command": "python benchmarks/corpus.py " + " ".join(os.sys.argv[1:]),
        "files": used,
        "tokens": int(len(tokens)),
        "vocab": tokenizer.get_vocab_size(),
        "sha256": digest,
    }
    with open(os.path.join(options.out, "corpus.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
