"""What the checks on the user's model cost before the first step (issue 50): on the QLoRA 7B model, the forwards
that show a layout exact ([`model_checks.check_layout`]) and read the loss ([`check_loss`]), each timed between
synchronizes, three times (the first in a fresh process), the building of a Trainer with `AdaptiveBatch()` (which runs
them) against the plain Trainer's, the memory they reach, and that they leave the RNG and the modules' modes as they
were; and what the check measures in bf16 on models that keep packed sequences apart and on some that do not (OPT, a
Falcon with ALiBi, shapes of 1.3B and 1B), to set its tolerance against.

    python benchmarks/model_check_cost.py --out $OUT --workdir /tmp/w1 [--tiny]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from common import build_model, save, sync
from ragged_throughput import lengths

from adaptive_batch import AdaptiveBatch
from adaptive_batch.runtime.model_checks import check_layout, check_loss

OTHERS = {  # bf16 models of other families, at real depths (random weights, not quantized)
    "OPTForCausalLM (1.3B shape)": (
        "OPTConfig",
        dict(
            hidden_size=2048,
            ffn_dim=8192,
            num_hidden_layers=24,
            num_attention_heads=32,
            word_embed_proj_dim=2048,
        ),
    ),
    "FalconForCausalLM, ALiBi (1B shape)": (
        "FalconConfig",
        dict(
            hidden_size=2048,
            num_hidden_layers=24,
            num_attention_heads=32,
            alibi=True,
            new_decoder_architecture=False,
        ),
    ),
    "LlamaForCausalLM (1B shape)": (
        "LlamaConfig",
        dict(
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
        ),
    ),
}
TINY_OTHERS = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)


def timed(call, repeats: int = 3) -> tuple[list[float], object]:
    seconds, result = [], None
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        result = call()
        sync()
        seconds.append(time.perf_counter() - started)
    return seconds, result


def verdict_record(verdict) -> dict:
    return {
        "exact": verdict.exact,
        "difference": verdict.difference,
        "changed_by_others": verdict.changed_by_others,
        "precision": verdict.precision,
        "tolerance": verdict.tolerance,
        "error": verdict.error,
        "text": verdict.text(),
    }


def qlora_checks(model, autocast) -> dict:
    """The checks on the QLoRA model, timed, with what they leave behind."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    rng = torch.cuda.get_rng_state() if device.type == "cuda" else torch.get_rng_state()
    modes = [m.training for m in model.modules()]
    allocated = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    record = {}
    for name, call in {
        "loss": lambda: check_loss(model, autocast=autocast),
        "packed_in_rows": lambda: check_layout(model, "packed", True, autocast=autocast),
        "unmasked": lambda: check_layout(model, "unmasked", autocast=autocast),
        "trimmed": lambda: check_layout(model, "trimmed", autocast=autocast),
    }.items():
        seconds, result = timed(call)
        record[name] = {
            "seconds": seconds,
            "result": verdict_record(result) if name != "loss" else vars(result),
        }
        print(f"{name:16} {[round(s, 3) for s in seconds]} s  {record[name]['result']}", flush=True)
    after = torch.cuda.get_rng_state() if device.type == "cuda" else torch.get_rng_state()
    record["rng_state_unchanged"] = bool(torch.equal(rng, after))
    record["modes_unchanged"] = modes == [m.training for m in model.modules()]
    if device.type == "cuda":
        record["peak_above_model_gib"] = (torch.cuda.max_memory_allocated() - allocated) / 2**30
        record["allocated_after_minus_before_gib"] = (torch.cuda.memory_allocated() - allocated) / 2**30
    return record


def trainer_builds(model, tiny: bool, workdir: str) -> dict:
    """Building the QLoRA Trainer on ragged rows, plain and with AdaptiveBatch() (which plans and runs the checks),
    alternately, three times each."""
    from base_model import qlora_trainer

    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, 30000, (n,), generator=generator).tolist()} for n in lengths(64)]

    def collate(features):
        width = max(len(f["input_ids"]) for f in features)
        ids = torch.zeros(len(features), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, f in enumerate(features):
            ids[i, : len(f["input_ids"])], mask[i, : len(f["input_ids"])] = torch.tensor(f["input_ids"]), 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    seconds = {"plain": [], "adaptive_batch": []}
    layout = None
    for _ in range(3):
        for arm in ("plain", "adaptive_batch"):
            callbacks = [AdaptiveBatch()] if arm == "adaptive_batch" else []
            sync()
            started = time.perf_counter()
            trainer = qlora_trainer(
                model, rows, callbacks, os.path.join(workdir, "out"), 8, 8, 4, tiny, collate
            )
            sync()
            seconds[arm].append(time.perf_counter() - started)
            if callbacks:
                layout = dict(callbacks[0].plan_table())["layout"]
            del trainer
    print(f"Trainer built in {seconds} s; layout: {layout}", flush=True)
    return {"seconds": seconds, "layout": layout}


def other_models(tiny: bool) -> dict:
    import transformers

    results = {}
    for name, (config_name, shape) in OTHERS.items():
        config = getattr(transformers, config_name)(**(TINY_OTHERS if tiny else shape), vocab_size=32000)
        config.use_cache = False  # (as the Trainer trains: args.use_cache)
        torch.manual_seed(0)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.config._attn_implementation = "sdpa"
        record = {}
        for layout, (kind, rows) in {
            "packed_in_rows": ("packed", True),
            "unmasked": ("unmasked", False),
        }.items():
            seconds, verdict = timed(lambda m=model, k=kind, r=rows: check_layout(m, k, r), repeats=1)
            record[layout] = {"seconds": seconds, **verdict_record(verdict)}
            print(f"{name:40} {layout:16} {verdict.text()}", flush=True)
        results[name] = record
        del model
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--tiny", action="store_true", help="a dry run on the CPU")
    options = parser.parse_args()
    from base_model import header

    os.makedirs(options.out, exist_ok=True)
    report = header(options.tiny)
    model, _ = build_model(options.tiny, options.workdir)
    model.config._attn_implementation = "sdpa"
    import contextlib

    # the Trainer's bf16=True: its accelerator's autocast
    autocast = (
        contextlib.nullcontext if options.tiny else lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    )
    report["qlora_checks"] = qlora_checks(model, autocast)
    save(report, os.path.join(options.out, "model_check_cost.json"))
    report["trainer_builds"] = trainer_builds(model, options.tiny, options.workdir)
    save(report, os.path.join(options.out, "model_check_cost.json"))
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    report["other_models_bf16"] = other_models(options.tiny)
    save(report, os.path.join(options.out, "model_check_cost.json"))
    checks = report["qlora_checks"]
    print("\ncheck (QLoRA 7B)  first s  then s")
    for name in ("loss", "packed_in_rows", "unmasked", "trimmed"):
        s = checks[name]["seconds"]
        print(f"{name:16}  {s[0]:7.3f}  {min(s[1:]):6.3f}")
    builds = report["trainer_builds"]["seconds"]
    print(
        f"Trainer build: plain {min(builds['plain']):.2f} s, AdaptiveBatch() {min(builds['adaptive_batch']):.2f} s"
    )


if __name__ == "__main__":
    main()
