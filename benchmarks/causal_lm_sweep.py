"""Which layout `AdaptiveBatch()` gives every causal LM the installed transformers builds small, under eager and sdpa,
and how far each run's update is from the plain Trainer's: the table in the README ("Which models are packed") and
docs/how-it-works.md come from its JSON. The same runs as tests/test_causal_lms.py, which asserts them.

    python benchmarks/causal_lm_sweep.py --out benchmarks/results/causal_lm_sweep.json [--types llama,opt] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import platform
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"


def start_worker() -> None:
    """One torch thread a worker (as many as cores in all), and the imported modules left out of the collection that
    ends every `Trainer.train()` (tests/conftest.py freezes them too)."""
    import gc

    sys.path.insert(0, str(TESTS))
    import causal_lms  # noqa: F401
    import test_causal_lms  # noqa: F401
    import torch

    torch.set_num_threads(1)
    gc.freeze()


def case(model_type: str, attention: str) -> dict:
    import torch
    import transformers
    from causal_lms import NOT_BUILDABLE, build_small, supports_sdpa
    from test_causal_lms import trained, trainer_for

    from adaptive_batch import AdaptiveBatch

    transformers.logging.set_verbosity_error()
    logging.getLogger("adaptive_batch").setLevel(logging.ERROR)
    result = {"model_type": model_type, "attention": attention}
    if model_type in NOT_BUILDABLE:
        return {**result, "skipped": NOT_BUILDABLE[model_type]}
    model = build_small(model_type)
    if attention == "sdpa" and not supports_sdpa(model):
        return {**result, "skipped": "no sdpa attention"}
    result.update(model_class=type(model).__name__, dtype=str(model.dtype).removeprefix("torch."))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        plain = trained(trainer_for(model_type, attention, [], tmp))

        def difference(updates: dict) -> float:
            scale = torch.sqrt(sum((u.double() ** 2).sum() for u in plain.values()))
            return float(
                torch.sqrt(sum(((updates[n] - plain[n]).double() ** 2).sum() for n in plain)) / scale
            )

        default = AdaptiveBatch()
        result["default"] = difference(trained(trainer_for(model_type, attention, [default], tmp)))
        result["layout"] = dict(default.plan_table())["layout"]
        stated = AdaptiveBatch(padding_free=True, micro_batch_size=3)
        try:
            trainer = trainer_for(model_type, attention, [stated], tmp)
        except ValueError as refused:
            result["padding_free_refused"] = str(refused)
        else:
            result["padding_free"] = difference(trained(trainer))
        cut = AdaptiveBatch(micro_batch_size=3, padding_free=False)
        result["padded_cut"] = difference(trained(trainer_for(model_type, attention, [cut], tmp)))
    result["seconds"] = time.perf_counter() - started
    return result


def guarded(model_type: str, attention: str) -> dict:
    """[`case`], or the error it raised (the test fails there; the sweep goes on)."""
    try:
        return case(model_type, attention)
    except Exception as error:  # noqa: BLE001 - recorded, not hidden: the table prints it
        message = (str(error).strip().splitlines() or [""])[0][:300]
        return {
            "model_type": model_type,
            "attention": attention,
            "error": f"{type(error).__name__}: {message}",
        }


def short_layout(text: str) -> str:
    for start in (
        "padding-free in rows",
        "padding-free",
        "padded, without the padding mask",
        "padded, with the padding mask",
    ):
        if text.startswith(start):
            return start
    return text.split(":")[0].split(" (")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--types", default="", help="comma-separated model types (default: all)")
    parser.add_argument("--workers", type=int, default=2)
    options = parser.parse_args()
    sys.path.insert(0, str(TESTS))
    import torch
    import transformers
    from causal_lms import causal_lm_types

    types = options.types.split(",") if options.types else causal_lm_types()
    cases = [(t, a) for t in types for a in ("eager", "sdpa")]
    started = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(options.workers, initializer=start_worker) as pool:
        results = pool.starmap(guarded, cases, chunksize=1)
    report = {
        "command": " ".join(sys.argv),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "machine": platform.platform(),
        "seconds": time.perf_counter() - started,
        "cases": results,
    }
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'type':24} {'attention':9} {'layout':34} {'default':>9} {'pf=True':>9} {'cut 3':>9}")
    for r in results:
        if "skipped" in r or "error" in r:
            why = f"skipped: {r['skipped']}" if "skipped" in r else f"error: {r['error']}"
            print(f"{r['model_type']:24} {r['attention']:9} {why}")
            continue
        stated = "refused" if "padding_free_refused" in r else f"{r['padding_free']:.1e}"
        print(
            f"{r['model_type']:24} {r['attention']:9} {short_layout(r['layout']):34} {r['default']:9.1e} "
            f"{stated:>9} {r['padded_cut']:9.1e}"
        )


if __name__ == "__main__":
    main()
