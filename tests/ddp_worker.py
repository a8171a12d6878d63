"""Run by launch.py for test_ddp.py and test_deepspeed.py, as 2 ranks (gloo: forked with torchrun's environment,
or under torchrun) or alone: a short run whose results the test compares.

usage: ddp_worker.py OUTPUT_DIR {trainer,stream,stream_workers,sft,tokens,packed,noise,growing,eval,branches}
       MICRO_BATCH_SIZE [FAKE_OOM_RANK]

`stream` is `trainer` with the rows given as a stream (an IterableDataset without a length) and max_steps=10;
`stream_workers` the same read through a DataLoader worker (so every rank reads the stream, instead of rank 0).
`fsdp2` is `trainer` under FSDP2 (`fully_shard`), which accelerate runs on CPU only through `cpu_fsdp2()`; `zero1`,
`zero2` and `zero3` are `trainer` under DeepSpeed ZeRO of that stage (`cpu_deepspeed()`). Under all of them the fake
out-of-memory error comes in the middle of the backward (at the first decoder layer), where most state is left behind.

With `tokens`, rows of 3 to 24 tokens are cut by a token budget of MICRO_BATCH_SIZE, every micro-batch is recorded,
and the fake out-of-memory error comes above 30 tokens instead of 1 row. `packed` is the same with the rows
flattened into one padding-free row a step (DataCollatorWithFlattening), cut between sequences. The fake error is raised in the forward
pass: with `sft`, before TRL's `compute_loss` gathers its metrics from every rank.

Runs use the ORDER_ONLY settings of helpers.py (float64, SGD): two ranks and one process add in different orders.

`noise` is another run (`noise_run`): helpers.py's `LinearRegression` at learning rate 0, whose gradient noise scale is
known in closed form, with every micro-batch's gradient captured on each rank. `growing` trains it with SGD under a
NoiseScaleSchedule, the ranks modelling their step times differently (`growing_run`).

`branches` trains helpers.py's `Branches`, whose branches get a gradient on one rank or none, with AdamW
(`branches_run`).
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))


def main(output_dir: str, kind: str, micro: str, fake_oom_rank: str | None = None) -> None:
    if kind == "noise":
        return noise_run(output_dir, int(micro))
    if kind == "growing":
        return growing_run(output_dir, int(micro))
    if kind == "eval":
        return eval_run(output_dir, int(micro), fake_oom_rank)
    if kind == "branches":
        return branches_run(output_dir, int(micro))
    from helpers import ORDER_ONLY, QUIET_CPU_RUN, Recording, keep_loss_in_float64
    from transformers import (
        DataCollatorForLanguageModeling,
        DataCollatorWithFlattening,
        Trainer,
        TrainingArguments,
    )

    from adaptive_batch import AdaptiveBatch, PhaseSchedule
    from adaptive_batch.testing import (
        FakeOutOfMemory,
        text_corpus,
        tiny_llama,
        token_dataset,
        train_tokenizer,
    )

    texts = text_corpus()
    tokenizer = train_tokenizer(texts[:1500], vocab_size=384)
    # WORKER_DTYPE: float32 under ZeRO-3, which refuses float64 parameters on the CPU as on a GPU (test_deepspeed.py,
    # benchmarks/engine_resets.py)
    dtype = getattr(torch, os.environ.get("WORKER_DTYPE", "")) if os.environ.get("WORKER_DTYPE") else None
    model = keep_loss_in_float64(tiny_llama(tokenizer).to(dtype or ORDER_ONLY["dtype"]))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if kind == "fsdp2":
        cpu_fsdp2()
    stage = int(kind[-1]) if kind.startswith("zero") else None
    accelerator_config = cpu_deepspeed(world_size) if stage is not None else None
    common = dict(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4 // world_size,
        num_train_epochs=2,
        learning_rate=ORDER_ONLY["learning_rate"],
        optim=ORDER_ONLY["optim"],
        **QUIET_CPU_RUN,
        ddp_backend="gloo" if world_size > 1 else None,
    )
    if kind == "fsdp2":
        common.update(fsdp="full_shard", fsdp_config={"version": 2})
    if stage is not None:
        common.update(use_cpu=False, deepspeed=deepspeed_config(stage), accelerator_config=accelerator_config)
    common.update(
        json.loads(os.environ.get("WORKER_ARGS", "{}"))
    )  # checkpoints, the GPU (benchmarks/engine_resets.py)
    schedule = PhaseSchedule([4, 8], boundaries=[0.5])
    # a fake out-of-memory error counts padded rows (a causal LM's ragged rows run padding-free in rows by default):
    # its runs, and the clean runs they are compared with (WORKER_PADDED), state the padded layout
    padded = fake_oom_rank is not None or os.environ.get("WORKER_PADDED")
    layout = {"padding_free": False} if padded and kind not in ("tokens", "packed") else {}
    if micro == "auto":  # on rows of varying length: cut by tokens, the overhead and budget measured
        callback = AdaptiveBatch(schedule=schedule, **layout)
    elif kind in ("tokens", "packed"):
        callback = AdaptiveBatch(schedule=schedule, max_tokens_per_micro_batch=int(micro))
    else:
        callback = AdaptiveBatch(schedule=schedule, micro_batch_size=int(micro), **layout)
    if kind in ("tokens", "packed"):
        rows = token_dataset(tokenizer, texts[:43], max_length=24)
        trainer = Recording(
            model=model,
            args=TrainingArguments(**common),
            train_dataset=[{"input_ids": r["input_ids"][: 3 + (7 * i) % 22]} for i, r in enumerate(rows)],
            data_collator=DataCollatorWithFlattening()
            if kind == "packed"
            else DataCollatorForLanguageModeling(tokenizer, mlm=False),
            callbacks=[callback],
        )
    elif kind in ("trainer", "stream", "stream_workers", "fsdp2") or stage is not None:
        rows = token_dataset(tokenizer, texts[:43], max_length=24)
        if kind.startswith("stream"):
            # 40 samples: 5 steps of 4, then 8, 8 and 4 (WORKER_ARGS may ask for more)
            common.setdefault("max_steps", 10)
            if kind == "stream_workers":
                common["dataloader_num_workers"] = 1
            reads = torch.zeros(1, dtype=torch.long).share_memory_()  # (counted in a worker too)

            class Stream(torch.utils.data.IterableDataset):
                def __iter__(self):
                    for row in rows:
                        reads.add_(1)
                        yield row

        trainer = Trainer(
            model=model,
            args=TrainingArguments(**common),
            train_dataset=Stream() if kind.startswith("stream") else rows,
            data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
            callbacks=[callback],
        )
    else:
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        trainer = SFTTrainer(
            model=model,
            args=SFTConfig(**common, max_length=24),
            train_dataset=Dataset.from_dict({"text": texts[:43]}),
            processing_class=tokenizer,
            callbacks=[callback],
        )
    rank = trainer.args.process_index
    watcher = None
    if fake_oom_rank == str(rank):
        limits = dict(max_rows=None, max_tokens=30) if kind in ("tokens", "packed") else dict(max_rows=1)
        # WORKER_OOM_AFTER: oversized micro-batches that pass first (1: the error in a step's last micro-batch)
        limits["only_after_calls"] = int(os.environ.get("WORKER_OOM_AFTER", "0"))
        if (
            kind == "fsdp2" or stage is not None
        ):  # mid-backward: the last layer's and root's gradients are made
            watcher = FakeOutOfMemory(trainer.model.model.layers[0], **limits, in_backward=True)
        else:
            watcher = FakeOutOfMemory(trainer.model, **limits)
    trainer.train(resume_from_checkpoint=os.environ.get("WORKER_RESUME"))
    session = callback.session
    result = {
        "rank": rank,
        "world_size": trainer.args.world_size,
        "plan": session.plan.fingerprint(),
        "logs": [log for log in trainer.state.log_history if "loss" in log],
        "raised": watcher.raised if watcher else [],
        # (step, rows, padded length, label tokens, sequences): a flattened row holds several sequences
        "micro_batches": [(*m[:4], len(m[4])) for m in getattr(trainer, "micro_batches", [])],
        "max_tokens": getattr(session.controller, "max_tokens", None),
        "controller": session.controller.state_dict(),
        "stream_reads": int(reads) if kind.startswith("stream") else None,  # samples this rank's stream gave
    }
    with open(os.path.join(output_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    weights = {k: _full(v).detach().cpu() for k, v in trainer.model.named_parameters()}
    torch.save(weights, f"{output_dir}/rank{rank}.pt")
    if torch.distributed.is_initialized():
        # a clean exit: a gloo group left to the interpreter's shutdown can abort a rank ("terminate called
        # without an active exception"), failing a run whose results were all written
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    if stage is not None:
        # DeepSpeed's threads still abort a rank at the interpreter's shutdown now and then (seen under ZeRO-3):
        # every result is written and every rank passed the barrier, so leave without the shutdown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter whole on every rank (an FSDP2 parameter is a sharded DTensor, a ZeRO-3 one a partition: gathered,
    on every rank alike)."""
    if hasattr(tensor, "full_tensor"):
        return tensor.full_tensor()
    if hasattr(tensor, "ds_id"):
        from deepspeed.utils import safe_get_full_fp32_param

        return safe_get_full_fp32_param(tensor)
    return tensor


def deepspeed_config(stage: int) -> dict:
    """Every batch field "auto" but train_batch_size, which accelerate fills before the CPU processes know of each
    other (DeepSpeed derives it); clipping from max_grad_norm."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**6,
        **json.loads(os.environ.get("WORKER_DEEPSPEED", "{}")),  # more of the config, for a test
    }


def cpu_deepspeed(world_size: int) -> dict | None:
    """DeepSpeed on CPU processes: no build of its shared-memory op, and with several processes, accelerate's state
    made with gloo before TrainingArguments (left to TrainingArguments, every CPU rank takes itself for rank 0 of 1).
    Returns the accelerator_config to pass."""
    from adaptive_batch.testing import skip_deepspeed_shm_build

    skip_deepspeed_shm_build()
    if world_size == 1:
        return None
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    return {"use_configured_state": True}


def cpu_fsdp2() -> None:
    """The test-only switch: accelerate turns an FSDP plugin on CPU processes into plain DDP (`MULTI_CPU`), although
    torch's `fully_shard` runs on CPU with gloo. Keep the plugin, as accelerate does on GPUs."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = fsdp_on_cpu


NOISE_STEPS, NOISE_EFFECTIVE_BATCH = 300, 64


def noise_run(output_dir: str, micro: int) -> None:
    """`LinearRegression` at learning rate 0 for NOISE_STEPS steps of NOISE_EFFECTIVE_BATCH fresh rows (the last one
    row short: 32 and 31 on two ranks) cut into micro-batches of `micro`: the logs, every micro-batch's (rows,
    gradient) on this rank and the step gradients before the optimizer."""
    from helpers import (
        QUIET_CPU_RUN,
        REGRESSION_NOISE_STD,
        REGRESSION_TARGET,
        REGRESSION_WEIGHT,
        GradientCapture,
        LinearRegression,
        RegressionRows,
    )
    from transformers import Trainer, TrainingArguments

    from adaptive_batch import AdaptiveBatch

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    callback = AdaptiveBatch(
        schedule=NOISE_EFFECTIVE_BATCH, micro_batch_size=micro, noise_time_constant_samples=1e9
    )
    trainer = Trainer(
        model=LinearRegression(REGRESSION_WEIGHT),
        args=TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=micro,
            num_train_epochs=1,
            learning_rate=0.0,
            max_grad_norm=0,
            **QUIET_CPU_RUN,
            ddp_backend="gloo" if world_size > 1 else None,
        ),
        train_dataset=RegressionRows(
            NOISE_STEPS * NOISE_EFFECTIVE_BATCH - 1, REGRESSION_TARGET, REGRESSION_NOISE_STD
        ),
        callbacks=[callback],
    )
    capture = GradientCapture(trainer.model).add_to(trainer)
    trainer.train()
    rank = trainer.args.process_index
    result = {
        "rank": rank,
        "logs": [log for log in trainer.state.log_history if "loss" in log],
        "lower_bound": callback.session.noise.lower_bound(),
        "parts": [[(rows, d.tolist()) for rows, d in step] for step in capture.parts],
        "step_gradients": [g.tolist() for g in capture.step_gradients],
    }
    with open(os.path.join(output_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    weights = {k: _full(v).detach().cpu() for k, v in trainer.model.named_parameters()}
    torch.save(weights, f"{output_dir}/rank{rank}.pt")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def growing_run(output_dir: str, micro: int) -> None:
    """SGD on `LinearRegression` (its noise scale rises as it converges) under NoiseScaleSchedule(32, max 256,
    goodput alone) with micro-batches of `micro` and the gain LR rule. Rank 0 models a step as 1 s + 0.02 s a row (a doubled batch pays once the noise scale
    passes 55), rank 1 as 1 s + 1 s a row (it never pays there): the ranks must still make the same changes. Writes
    the changes, the plan, the logs and the first coordinate of every row this rank trained on."""
    from helpers import (
        QUIET_CPU_RUN,
        REGRESSION_NOISE_STD,
        REGRESSION_TARGET,
        REGRESSION_WEIGHT,
        LinearRegression,
        RegressionRows,
    )
    from transformers import Trainer, TrainingArguments

    from adaptive_batch import AdaptiveBatch, NoiseScaleSchedule
    from adaptive_batch.core.goodput import StepTimeModel

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    per_row = 0.02 if int(os.environ.get("RANK", "0")) == 0 else 1.0
    StepTimeModel.predict = lambda self, rows, micro_batches: 1.0 + per_row * rows
    schedule = NoiseScaleSchedule(
        32, max_size=256, min_samples_between_changes=640, min_efficiency=None
    )  # goodput alone
    callback = AdaptiveBatch(
        schedule=schedule, micro_batch_size=micro, noise_time_constant_samples=320, lr_scaling="gain"
    )
    trainer = Trainer(
        model=LinearRegression(REGRESSION_WEIGHT),
        args=TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=micro,
            num_train_epochs=1,
            learning_rate=0.05,
            lr_scheduler_type="constant",
            optim="sgd",
            max_grad_norm=0,
            **QUIET_CPU_RUN,
            ddp_backend="gloo" if world_size > 1 else None,
        ),
        train_dataset=RegressionRows(6400, REGRESSION_TARGET, REGRESSION_NOISE_STD),
        callbacks=[callback],
    )
    seen: list[float] = []
    trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.extend(kwargs["x"][:, 0].tolist()), with_kwargs=True
    )
    trainer.train()
    rank = trainer.args.process_index
    result = {
        "rank": rank,
        "changes": schedule.state_dict()["changes"],
        "plan": list(callback.session.plan.sizes),
        "max_steps": trainer.state.max_steps,
        "global_step": trainer.state.global_step,
        "logs": [log for log in trainer.state.log_history if "loss" in log],
        "seen": seen,
        "dataset": trainer.train_dataset.x[:, 0].tolist(),
    }
    with open(os.path.join(output_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    weights = {k: _full(v).detach().cpu() for k, v in trainer.model.named_parameters()}
    torch.save(weights, f"{output_dir}/rank{rank}.pt")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def branches_run(output_dir: str, micro: int) -> None:
    """`Branches` (helpers.py) under AdamW with weight decay 0.1: 64 rows, one epoch of steps of 8 rows,
    micro-batches (per-device batches) of `micro` rows. WORKER_PLAIN: the plain Trainer without AdaptiveBatch.
    At one row, its per-device batches are the rows of AdaptiveBatch's micro-batches, in the same order, on the
    same rank: the gradients add up in the same order, so the two runs may be compared bit for bit."""
    from helpers import QUIET_CPU_RUN, REGRESSION_NOISE_STD, REGRESSION_TARGET, Branches, RegressionRows
    from transformers import Trainer, TrainingArguments

    from adaptive_batch import AdaptiveBatch

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    plain = bool(os.environ.get("WORKER_PLAIN"))
    trainer = Trainer(
        model=Branches(rank=int(os.environ.get("RANK", "0"))),
        args=TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=8 // (micro * world_size),
            num_train_epochs=1,
            learning_rate=1e-2,
            optim="adamw_torch",
            weight_decay=0.1,
            **QUIET_CPU_RUN,
            ddp_backend="gloo" if world_size > 1 else None,
            # plain DDP needs it for a branch a rank leaves unused (without it DDP raises at the next step)
            ddp_find_unused_parameters=True,
        ),
        train_dataset=RegressionRows(64, REGRESSION_TARGET, REGRESSION_NOISE_STD),
        callbacks=[] if plain else [AdaptiveBatch(micro_batch_size=micro)],
    )
    trainer.train()
    rank = trainer.args.process_index
    result = {"rank": rank, "logs": [log for log in trainer.state.log_history if "loss" in log]}
    with open(os.path.join(output_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    weights = {k: v.detach().cpu() for k, v in trainer.model.named_parameters()}
    torch.save(weights, f"{output_dir}/rank{rank}.pt")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def eval_run(output_dir: str, eval_batch: int, fake_oom_rank: str | None) -> None:
    """`Trainer.evaluate()` of the tiny Llama (float64) over 22 rows at `per_device_eval_batch_size=eval_batch`,
    on every rank; the rank `fake_oom_rank` runs out of memory above one row. Writes the metrics and what
    `compute_metrics` got (its predictions as .npy). WORKER_UNEVEN: 21 rows with the Accelerator's
    `even_batches=False`, so that the ranks' last eval batches differ. WORKER_GROW="4,2,1;4,4,4": with
    `adapt_evaluation="grow"`, one evaluation per duration, rank r's evaluations timed as the r-th list says.
    WORKER_RAGGED: rows cut to lengths 3 to 24 and no `compute_metrics` (the Trainer keeps no logits);
    WORKER_OVERHEAD_RANK0=N: rank 0's fitted fixed time of an eval forward, N tokens (the other ranks' unknown)."""
    import numpy as np
    from helpers import QUIET_CPU_RUN, eval_pieces, keep_loss_in_float64
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from adaptive_batch import AdaptiveBatch
    from adaptive_batch.testing import (
        FakeOutOfMemory,
        text_corpus,
        tiny_llama,
        token_dataset,
        train_tokenizer,
    )

    texts = text_corpus()
    tokenizer = train_tokenizer(texts[:1500], vocab_size=384)
    rows = token_dataset(tokenizer, texts[:60], max_length=24)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    uneven = bool(os.environ.get("WORKER_UNEVEN"))
    grow = os.environ.get("WORKER_GROW")
    ragged = bool(os.environ.get("WORKER_RAGGED"))
    got = {}

    def compute_metrics(prediction):
        got["predictions"], got["label_ids"] = prediction.predictions, prediction.label_ids
        return {"rows": float(len(prediction.label_ids))}

    trainer = Trainer(
        model=keep_loss_in_float64(tiny_llama(tokenizer).to(torch.float64)),
        args=TrainingArguments(
            output_dir=output_dir,
            per_device_eval_batch_size=eval_batch,
            **QUIET_CPU_RUN,
            ddp_backend="gloo" if world_size > 1 else None,
            accelerator_config={"even_batches": False} if uneven else None,
        ),
        train_dataset=rows[:16],
        eval_dataset=rows[30:51] if uneven else rows[30:52],
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        compute_metrics=None if ragged else compute_metrics,
        callbacks=[AdaptiveBatch(adapt_evaluation="grow" if grow else True)],
    )
    if ragged:
        trainer.eval_dataset = [
            {"input_ids": row["input_ids"][: 3 + (5 * i) % 22]} for i, row in enumerate(trainer.eval_dataset)
        ]
    rank = trainer.args.process_index
    if os.environ.get("WORKER_OVERHEAD_RANK0") and rank == 0:
        eval_pieces(trainer).overhead = int(os.environ["WORKER_OVERHEAD_RANK0"])
    watcher = None
    if fake_oom_rank == str(rank):
        watcher = FakeOutOfMemory(trainer.model, max_rows=1, in_eval=True)
    durations = [float(d) for d in grow.split(";")[rank].split(",")] if grow else [0.0]
    if grow:
        from helpers import BlockClock

        import adaptive_batch.runtime.memory

        adaptive_batch.runtime.memory.time = BlockClock(durations)
    evaluations = [trainer.evaluate() for _ in durations]
    metrics = evaluations[-1]
    result = {
        "rank": rank,
        "metrics": metrics,
        "evaluations": evaluations,
        "raised": watcher.raised if watcher else [],
    }
    with open(os.path.join(output_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if got:
        np.save(os.path.join(output_dir, f"predictions{rank}.npy"), got["predictions"])
        np.save(os.path.join(output_dir, f"labels{rank}.npy"), got["label_ids"])
    torch.save({}, f"{output_dir}/rank{rank}.pt")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
