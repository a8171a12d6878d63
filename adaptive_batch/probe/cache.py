"""The probe's cache: reports stored per setup ([`describe_setup`]: what changes memory) and sequence length, and
the lookup a run starts from ([`cached_start`]). On the Trainer's path: it imports no trial runner or model loading."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..runtime.compat.trainer import CONFIG_BOOKKEEPING_KEYS

if TYPE_CHECKING:
    from .search import ProbeReport

CACHE_ENV = "ADAPTIVE_BATCH_CACHE"
# a setup of another model differs in dozens of config keys: name a few, count the rest
MAX_NAMED_DIFFERENCES = 4


@dataclass(frozen=True)
class CachedStart:
    """The recommended `size` probed at `seq_len` (`None`: no entry), a line for the log, and the largest micro-batch
    and eval batch found to fit where a larger one failed."""

    size: int | None = None
    seq_len: int | None = None
    message: str | None = None
    boundary: int | None = None
    eval_boundary: int | None = None


def cached_start(setup: dict, seq_len: int) -> CachedStart:
    """The recommendation at the shortest probed length >= `seq_len` (what fits longer sequences fits shorter ones)."""
    path = _cache_file(setup)
    try:
        entries = json.loads(path.read_text()) if path.exists() else {}
    except ValueError as error:
        return CachedStart(
            message=f"adaptive-batch probe's cache file {path} could not be read ({error}); delete it and re-run "
            "`adaptive-batch probe` for this setup.",
        )
    lengths = sorted(int(length) for length in entries)
    if not lengths:
        return CachedStart(message=_no_entry_message(setup))
    covering = [length for length in lengths if length >= seq_len]
    if not covering:
        return CachedStart(
            message=f"adaptive-batch probe's cache holds this setup up to {lengths[-1]:,} tokens, and this run needs "
            f"{seq_len:,}: re-run `adaptive-batch probe` with --seq-len {seq_len}.",
        )
    entry = entries[str(covering[0])]
    size = int(entry["recommended"])
    failed, eval_failed = entry.get("first_failing"), entry.get("eval_first_failing")
    return CachedStart(
        size,
        covering[0],
        f"adaptive-batch probe's choice for this setup at {covering[0]:,} tokens: {size} samples per micro-batch; "
        '"auto" starts from it, at most what a step holds (the plan table says where).',
        boundary=int(entry["boundary"]) if failed is not None else None,
        eval_boundary=int(entry["eval_boundary"])
        if eval_failed is not None and entry.get("eval_boundary")
        else None,
    )


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "adaptive-batch" / "probe")


def save_report(report: ProbeReport) -> Path:
    path = _cache_file(report.setup)
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = json.loads(path.read_text()) if path.exists() else {}
    entries[str(report.seq_len)] = report.to_dict()
    path.write_text(json.dumps(entries, indent=1, default=str))
    return path


def default_optim() -> str:
    """The optimizer a TrainingArguments builds when `optim` is not given (it changes between releases)."""
    from transformers import TrainingArguments

    default = TrainingArguments.__dataclass_fields__["optim"].default
    return str(getattr(default, "value", default))


def describe_setup(model: torch.nn.Module, optim: str, gradient_checkpointing: bool) -> dict:
    """What changes memory, read off a live model: the same dict whether it comes from the CLI or a Trainer."""
    import transformers

    optim = getattr(optim, "value", optim)  # TrainingArguments holds an OptimizerNames member
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.to_dict()
    quantization = config.pop("quantization_config", None)
    for key in CONFIG_BOOKKEEPING_KEYS:
        config.pop(key, None)
    peft_config = getattr(model, "peft_config", {}).get("default")
    lora = None
    if peft_config is not None:
        targets = peft_config.target_modules
        lora = {
            "r": peft_config.r,
            "alpha": peft_config.lora_alpha,
            "targets": sorted(targets) if isinstance(targets, (set, list, tuple)) else targets,
        }
    dtype = str(next(p for p in base.parameters() if p.dtype.is_floating_point).dtype)
    device = next(model.parameters()).device
    return {
        "model": config,
        "dtype": dtype,
        "quantization": {k: str(v) for k, v in quantization.items()}
        if isinstance(quantization, dict)
        else None,
        "lora": lora,
        "gradient_checkpointing": bool(gradient_checkpointing),
        "optim": optim,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def _cache_file(setup: dict) -> Path:
    """The file of `setup`'s entries: named by a hash of the setup as JSON, whatever the sequence length."""
    text = json.dumps(_without_seq_len(setup), sort_keys=True, default=str)
    return cache_dir() / f"{hashlib.sha256(text.encode()).hexdigest()[:20]}.json"


def _without_seq_len(setup: dict) -> dict:
    return {k: v for k, v in setup.items() if k != "seq_len"}


def _no_entry_message(setup: dict) -> str | None:
    """What differs from the nearest cached setup of the same model; `None` where none is of this model."""
    # the cache holds the setup as JSON: compare this one as JSON too, or a tuple would differ from its list
    now = json.loads(json.dumps(_without_seq_len(setup), default=str))
    cached = [other for other in _cached_setups() if other.get("model") == now.get("model")]
    if not cached:
        return None
    # the nearest: the fewest top-level keys that differ, then the fewest leaves
    differences = min(
        (_differences(other, now) for other in cached),
        key=lambda found: (len({keys[0] for keys, _, _ in found}), len(found)),
    )
    named = "; ".join(
        f"{'.'.join(keys)} ({old} in the cache, {new} now)"
        for keys, old, new in differences[:MAX_NAMED_DIFFERENCES]
    )
    more = len(differences) - MAX_NAMED_DIFFERENCES
    named += f"; and {more} more" if more > 0 else ""
    return (
        f"adaptive-batch probe's cache holds no entry for this setup; the nearest cached setup differs in {named}: "
        "re-run `adaptive-batch probe` for this setup to start from a probed micro-batch."
    )


def _cached_setups() -> list[dict]:
    """The setup of every readable cache file, in file-name order (the nearest one is then the same every time)."""
    setups = []
    for path in sorted(cache_dir().glob("*.json")):
        try:
            entries = json.loads(path.read_text())
        except (OSError, ValueError):  # a damaged file of another setup says nothing about this one
            continue
        if not isinstance(entries, dict):
            continue
        setup = next((e.get("setup") for e in entries.values() if isinstance(e, dict)), None)
        if isinstance(setup, dict):
            setups.append(_without_seq_len(setup))
    return setups


def _differences(cached, now, keys: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str, str]]:
    """`(keys, cached value, value now)` of every leaf that differs, `keys` the path to it."""
    if isinstance(cached, dict) and isinstance(now, dict):
        found = []
        for key in sorted(cached.keys() | now.keys()):
            found += _differences(cached.get(key, _ABSENT), now.get(key, _ABSENT), (*keys, key))
        return found
    return [] if cached == now else [(keys, _show(cached), _show(now))]


class _Absent:
    def __repr__(self) -> str:
        return "absent"


_ABSENT = _Absent()


def _show(value) -> str:
    return str(value) if not isinstance(value, (dict, list)) else json.dumps(value, sort_keys=True)
