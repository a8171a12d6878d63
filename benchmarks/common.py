"""What the benchmark scripts share: the device's clock (`sync`, `StepClock`), the run's header facts (`device_name`,
`versions`), writing a report (`save`), the QLoRA model most of them train (`build_model`), the arms' deadline
(`Deadline`), counting and reading a Trainer's steps (`train`, `logged`, `increments`), and the small model and
held-out evaluation of time_to_loss.py and time_to_quality.py (`scratch_model`, `EvalClock`, `first_at`).

A script run as `python benchmarks/NAME.py` finds this module beside it; importing it puts the repository root on
`sys.path`, so that `adaptive_batch` imports from the checkout without an install. The model's shapes and the QLoRA
Trainer are in base_model.py, the order of arms and their warm-ups in rounds.py.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from base_model import LLAMA2_7B, TINY, save_random_llama  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_name() -> str:
    """The GPU's name, else the processor's."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"


def versions(*packages: str) -> dict:
    """`{name: version}` of torch, transformers and `packages`, for a report's header."""
    return {name: importlib.import_module(name).__version__ for name in ("torch", "transformers", *packages)}


def save(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def build_model(tiny: bool, workdir: str):
    """The base model as a user loads it: 4-bit NF4 from a saved checkpoint, then LoRA through peft."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig

    shape = TINY if tiny else LLAMA2_7B
    started = time.perf_counter()
    path = save_random_llama(os.path.join(workdir, "llama-base"), shape, on_gpu=not tiny)
    config = LlamaConfig(**shape, use_cache=False)
    if tiny:
        model = AutoModelForCausalLM.from_pretrained(path)
    else:
        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
        model = AutoModelForCausalLM.from_pretrained(
            path, quantization_config=quantization, dtype=torch.bfloat16, device_map={"": 0}
        )
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    model = get_peft_model(
        model,
        LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.05, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
        ),
    )
    print(f"model ready in {time.perf_counter() - started:.0f} s", flush=True)
    return model, config


class StepClock:
    """Wall time of every optimizer step, the device synchronised at each step end."""

    def __init__(self):
        from transformers import TrainerCallback

        clock = self

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                sync()
                clock.marks = [time.perf_counter()]

            def on_step_end(self, args, state, control, **kwargs):
                sync()
                clock.marks.append(time.perf_counter())

        self.callback = Callback()
        self.marks: list[float] = []

    @property
    def step_seconds(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


class Deadline:
    """Runs arms, timed; starts none that would end after `seconds` from now (0: no limit), judged by the longest
    arm so far."""

    def __init__(self, seconds: float):
        self.seconds, self.started, self.longest = seconds, time.perf_counter(), 0.0

    def allows_another(self) -> bool:
        return not self.seconds or time.perf_counter() - self.started + self.longest <= self.seconds

    def run(self, arm, *args) -> dict:
        """`arm(*args)`, its result with the seconds it took (`seconds`)."""
        started = time.perf_counter()
        result = arm(*args)
        result["seconds"] = time.perf_counter() - started
        self.longest = max(self.longest, result["seconds"])
        return result


class ForwardCounter:
    """The forwards of a model in every optimizer step (a pre-hook on its forward: a micro-batch that ran out of
    memory counts too), in `per_step`; `callback` goes to the Trainer."""

    def __init__(self, model):
        from transformers import TrainerCallback

        counter = self
        self.calls = 0
        self.per_step: list[int] = []
        self.handle = model.register_forward_pre_hook(self._count)

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                counter.calls = 0

            def on_step_end(self, args, state, control, **kwargs):
                counter.per_step.append(counter.calls)
                counter.calls = 0

        self.callback = Callback()

    def _count(self, module, args):
        self.calls += 1

    def remove(self) -> None:
        self.handle.remove()


def train(trainer) -> list[int]:
    """`trainer.train()`, the device's peak memory reset first; returns the forwards of the model in each step."""
    forwards = ForwardCounter(trainer.model)
    trainer.add_callback(forwards.callback)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        trainer.train()
    finally:
        forwards.remove()
    return forwards.per_step


def logged(trainer, key: str) -> list:
    """A value of every step's training log (`None` where a step did not log it)."""
    return [log.get(key) for log in trainer.state.log_history if "loss" in log]


def increments(running: list) -> list[int]:
    """Each step's part of a running count logged at every step."""
    return [int(b - a) for a, b in zip([0, *running], running)]


def scratch_model(vocab: int, seq_len: int, tiny: bool, seed: int):
    """A small Llama with random weights, trained from scratch by time_to_loss.py and time_to_quality.py."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    size = (
        dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4)
        if tiny
        else dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8)
    )
    config = LlamaConfig(
        vocab_size=vocab,
        max_position_embeddings=seq_len,
        num_key_value_heads=size["num_attention_heads"],
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        **size,
    )
    return LlamaForCausalLM(config)


class EvalClock:
    """A callback: the held-out loss every `every` samples (as `adaptive`'s plan counts them), and the training time
    without the evaluations."""

    def __init__(self, held_out: torch.Tensor, every: int, adaptive, batch: int = 128):
        from transformers import TrainerCallback

        self.held_out, self.every, self.adaptive, self.batch = held_out, every, adaptive, batch
        self.points: list[dict] = []
        self.eval_seconds = 0.0
        self.start = None
        clock = self

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kwargs):
                clock.model = model
                clock.evaluate(0, 0)
                clock.start = clock.now()

            def on_step_end(self, args, state, control, **kwargs):
                samples = clock.adaptive.plan.samples_before_step[state.global_step]
                if samples // clock.every > clock.done or state.global_step == state.max_steps:
                    clock.evaluate(samples, state.global_step)

        self.done = -1
        self.callback = Callback()

    def now(self) -> float:
        sync()
        return time.perf_counter()

    def evaluate(self, samples: int, step: int) -> None:
        began = self.now()
        train_seconds = 0.0 if self.start is None else began - self.start - self.eval_seconds
        model = self.model
        model.eval()
        losses = []
        with (
            torch.no_grad(),
            torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=model.device.type == "cuda"),
        ):
            for first in range(0, len(self.held_out), self.batch):
                ids = self.held_out[first : first + self.batch].to(model.device)
                losses.append(float(model(input_ids=ids, labels=ids).loss) * len(ids))
        model.train()
        self.points.append(
            {
                "samples": samples,
                "step": step,
                "train_seconds": train_seconds,
                "eval_loss": sum(losses) / len(self.held_out),
            }
        )
        self.done = samples // self.every
        if self.start is not None:
            self.eval_seconds += self.now() - began


def first_at(points: list[dict], target: float) -> dict | None:
    for point in points:
        if point["samples"] > 0 and point["eval_loss"] <= target:
            return point
    return None
