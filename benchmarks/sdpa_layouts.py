"""Which layout of one step's ragged sequences runs fastest under sdpa (or eager): forward and backward only, no
Trainer, to decide a layout before building it into the plugin.

Layouts of each step's rows (the same 64 sequences a step for every layout, drawn from ragged_throughput's `--mix`):
- `padded`: right-padded rows without a padding mask, longest first, cut as `AdaptiveBatch()` cuts them under sdpa
  (`core/cut.cheapest_chunks`, token budget `--budget`, a micro-batch's overhead `--overhead` padded tokens);
- `rows`: the sequences packed (first fit, longest first) into rows as wide as the step's longest sequence (rounded
  up to 64), `position_ids` restarting at every sequence and no attention mask, so that transformers builds a
  block-diagonal mask; rows cut into micro-batches of at most `--budget` tokens;
- `flat2`: the step flattened into two rows of one micro-batch each, as the plain `DataCollatorWithFlattening` at
  32 x 2 runs it.

The model runs under bf16 autocast on the GPU, as the Trainer runs it with `bf16=True` (the first H100 call,
`results/sdpa_layouts_h100_no_autocast.json`, ran without: its activations were float32). The loss of every layout
is the sum of its tokens' cross entropy over the step's target tokens (as the Trainer's `num_items_in_batch` makes
it); the report states each layout's first-step loss, which must agree to bf16 rounding. Arms run in
order-reversed rounds after one unrecorded step of their own.

    python benchmarks/sdpa_layouts.py --out OUT --mix sft,bimodal --steps 6
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from common import build_model, device_name, save, sync, versions
from ragged_throughput import MIXES, lengths
from rounds import add_arguments, interleaved

from adaptive_batch.core.cut import cheapest_chunks

STEP_ROWS = 64
LAYOUTS = ("padded", "rows", "flat2")


def padded(step: list[list[int]], budget: int, overhead: int) -> list[dict]:
    order = sorted(step, key=len, reverse=True)
    sizes = cheapest_chunks([len(s) for s in order], budget, None, overhead)
    out, start = [], 0
    for size in sizes:
        chunk = order[start : start + size]
        start += size
        width = len(chunk[0])
        ids = torch.zeros(size, width, dtype=torch.long)
        labels = torch.full((size, width), -100, dtype=torch.long)
        for i, sequence in enumerate(chunk):
            ids[i, : len(sequence)] = torch.tensor(sequence)
            labels[i, : len(sequence)] = torch.tensor(sequence)
        out.append({"input_ids": ids, "labels": labels})
    return out


def pack_rows(sequences: list[list[int]], width: int) -> list[dict]:
    """Rows of `width` tokens, first fit longest first, each sequence's first label ignored, tails filled by a dummy
    sequence whose labels are ignored."""
    rows: list[list[list[int]]] = []
    for sequence in sorted(sequences, key=len, reverse=True):
        for row in rows:
            if sum(map(len, row)) + len(sequence) <= width:
                row.append(sequence)
                break
        else:
            rows.append([sequence])
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for sequence in row:
            n = len(sequence)
            ids[r, at : at + n] = torch.tensor(sequence)
            labels[r, at + 1 : at + n] = torch.tensor(sequence[1:])
            positions[r, at : at + n] = torch.arange(n)
            at += n
        positions[r, at:] = torch.arange(width - at)  # the tail: a sequence of its own, no targets
    return [{"input_ids": ids, "labels": labels, "position_ids": positions}]


def rows(step: list[list[int]], budget: int) -> list[dict]:
    width = -(-max(map(len, step)) // 64) * 64
    packed = pack_rows(step, width)[0]
    per = max(1, budget // width)
    count = packed["input_ids"].shape[0]
    return [{key: value[i : i + per] for key, value in packed.items()} for i in range(0, count, per)]


def flat2(step: list[list[int]]) -> list[dict]:
    halves = [step[: len(step) // 2], step[len(step) // 2 :]]
    out = []
    for half in halves:
        width = sum(map(len, half))
        out.extend(pack_rows(half, width))
    return out


def layout(name: str, step, options) -> list[dict]:
    if name == "padded":
        return padded(step, options.budget, options.overhead)
    if name == "rows":
        return rows(step, options.budget)
    return flat2(step)


def run_step(model, micro_batches: list[dict]) -> tuple[float, int, int]:
    """(summed loss, target tokens, tokens run) of one step's forward and backward."""
    targets = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in micro_batches)
    total, run = 0.0, 0
    for mb in micro_batches:
        mb = {key: value.to(model.device) for key, value in mb.items()}
        with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=model.device.type == "cuda"):
            # (as the Trainer runs it under bf16=True; the first H100 call ran without, its activations float32)
            logits = model(**{k: v for k, v in mb.items() if k != "labels"}).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), mb["labels"][:, 1:].reshape(-1), reduction="sum"
        )
        (loss / targets).backward()
        total += float(loss.detach())
        run += mb["input_ids"].numel()
    model.zero_grad(set_to_none=True)
    return total / targets, targets, run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--workdir", default="/tmp/adaptive-batch-bench")
    parser.add_argument("--tiny", action="store_true", help="a CPU dry run on a tiny model")
    parser.add_argument("--mix", default="sft,bimodal", help=", ".join(MIXES))
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--budget", type=int, default=16384, help="tokens a micro-batch may hold")
    parser.add_argument(
        "--overhead", type=int, default=1000, help="padded tokens a micro-batch costs (padded)"
    )
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"])
    add_arguments(parser)
    options = parser.parse_args()
    os.makedirs(options.out, exist_ok=True)
    os.makedirs(options.workdir, exist_ok=True)
    model, config = build_model(options.tiny, options.workdir)
    model.train()  # (as the Trainer runs it: gradient checkpointing on)
    if options.attention != "sdpa":
        model.set_attn_implementation(options.attention)
    report = {"command": "benchmarks/sdpa_layouts.py", "options": vars(options), "device": device_name()}
    report["versions"], report["mixes"] = versions("peft"), {}
    generator = torch.Generator().manual_seed(0)
    for mix in options.mix.split(","):
        count = STEP_ROWS * (options.steps + 1)
        drawn = lengths(count, mix)
        data = [torch.randint(3, config.vocab_size, (n,), generator=generator).tolist() for n in drawn]
        steps = [data[i : i + STEP_ROWS] for i in range(0, count, STEP_ROWS)]
        real = [sum(map(len, step)) for step in steps]
        result = {"distribution": MIXES[mix], "real_tokens_per_step": real, "arms": []}
        for round_, name in interleaved(options.layouts.split(","), options.rounds):
            if round_ == 0:
                run_step(model, layout(name, steps[0], options))  # its own warm-up step, unrecorded
            losses, seconds, ran, micro = [], [], [], []
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            for step in steps[1:]:
                batches = layout(name, step, options)
                sync()
                started = time.perf_counter()
                loss, _, run = run_step(model, batches)
                sync()
                seconds.append(time.perf_counter() - started)
                losses.append(loss)
                ran.append(run)
                micro.append(len(batches))
            peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
            arm = {"layout": name, "round": round_, "step_seconds": seconds, "losses": losses}
            arm.update(tokens_run=ran, micro_batches=micro, peak_allocated_gib=peak)
            arm["real_tokens_per_second"] = sum(real[1:]) / sum(seconds)
            result["arms"].append(arm)
            print(
                f"{mix} r{round_} {name}: {arm['real_tokens_per_second']:.0f} real tokens/s, micro {micro}",
                flush=True,
            )
            report["mixes"][mix] = result
            save(report, os.path.join(options.out, "sdpa_layouts.json"))
    print(f"\n{report['device']}, {options.attention}")
    for mix, result in report["mixes"].items():
        for name in options.layouts.split(","):
            arms = [a for a in result["arms"] if a["layout"] == name]
            seconds = sum(sum(a["step_seconds"]) for a in arms)
            tokens = len(arms) * sum(result["real_tokens_per_step"][1:])
            print(
                f"{mix:8} {name:7} {tokens / seconds:8.0f} real tokens/s  first loss {arms[0]['losses'][0]:.5f}"
            )


if __name__ == "__main__":
    main()
