"""`probe` and `adaptive-batch probe` on the CPU, against a memory budget (bitsandbytes 4-bit and LoRA included)."""

import json
import math

import pytest
import torch

from adaptive_batch import AdaptiveBatch
from adaptive_batch.cli import main
from adaptive_batch.probe import probe
from adaptive_batch.testing import FakeOutOfMemory, tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(tokenizer).save_pretrained(path)
    return path


def run_cli(capsys, model_dir, options: str):
    code = main(["probe", str(model_dir), *options.split()])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_sizes_tried_against_a_model_that_runs_out_of_memory_above_five(tokenizer):
    model = tiny_llama(tokenizer)
    watcher = FakeOutOfMemory(model, max_rows=5)
    report = probe(model, seq_len=16, memory_budget=math.inf, max_size=64)
    assert watcher.sizes == [1, 1, 2, 4, 8, 6, 5]  # warm-up, 1-2-4, doubling to the first failure, bisection
    assert report.boundary == 5 and report.first_failing == 6
    assert [t["size"] for t in report.trials] == [1, 2, 4, 5, 6, 8]
    assert report.recommended in (1, 2, 4, 5)


def test_a_trial_over_the_limit_is_stopped_there(tokenizer):
    model = tiny_llama(tokenizer)

    def peaks(report):
        return {t["size"]: t["peak_bytes"] for t in report.trials}

    full = peaks(probe(model, seq_len=64, memory_budget=math.inf, max_size=8, largest=True))
    limit = (full[4] + full[8]) / 2  # 4 fits, 8 does not
    report = probe(model, seq_len=64, memory_budget=limit, max_size=16)
    assert 4 <= report.boundary < 8
    assert all(t["peak_bytes"] <= limit for t in report.trials if t["fits"])
    over = [t for t in report.trials if t["stopped"]]
    assert over and all(not t["fits"] and t["tokens_per_second"] is None for t in over)
    for trial in over:  # stopped on passing the limit, short of the peak the whole step reaches
        whole = peaks(probe(model, seq_len=64, memory_budget=math.inf, max_size=trial["size"], largest=True))
        assert limit < trial["peak_bytes"] < whole[trial["size"]]


def test_the_probe_leaves_the_model_and_the_random_state_as_found(tokenizer):
    model = tiny_llama(tokenizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    model.eval()
    probe(model, seq_len=16, memory_budget=64 * 2**20, max_size=32)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert not model.training


def test_cli_probe_of_a_4bit_lora_model_on_the_cpu(capsys, model_dir, probe_cache):
    options = (
        "--seq-len 32 --cpu --memory-budget 0.05 --dtype fp32 --load-in-4bit --lora-r 4 "
        "--lora-target q_proj,v_proj --optim paged_adamw_8bit --effective-batch 48 --json"
    )
    code, out, err = run_cli(capsys, model_dir, options)
    assert code == 0, err
    result = json.loads(out)
    limit = 0.05 * 2**30
    by_size = {t["size"]: t for t in result["trials"]}
    assert by_size[result["boundary"]]["peak_bytes"] <= limit
    failing = by_size[result["first_failing"]]
    assert failing["out_of_memory"] or failing["peak_bytes"] > limit
    assert result["first_failing"] <= max(result["boundary"] + 1, math.ceil(result["boundary"] * 1.05))
    assert [t["size"] for t in result["trials"]][:3] == [1, 2, 4]
    assert result["boundary_tokens"] == result["boundary"] * 32
    per_device, accumulation = result["per_device_train_batch_size"], result["gradient_accumulation_steps"]
    assert per_device * accumulation == 48 and per_device <= result["recommended"]
    assert result["setup"]["lora"] == {"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}
    assert result["setup"]["quantization"]["load_in_4bit"] == "True"
    cached = json.loads((probe_cache / result["cache_file"].rsplit("/", 1)[-1]).read_text())
    assert cached["32"]["boundary"] == result["boundary"]


def test_adaptive_batch_starts_at_the_probed_size(capsys, make_trainer, tokenizer, tmp_path, rows):
    from datasets import Dataset

    path = tmp_path / "base"
    tiny_llama(tokenizer).save_pretrained(path)
    options = "--seq-len 32 --cpu --memory-budget 0.02 --dtype fp32 --no-gradient-checkpointing --json"
    code, out, _ = run_cli(capsys, path, options)
    assert code == 0
    recommended = json.loads(out)["recommended"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    model.config.use_cache = False
    dataset = Dataset.from_list(rows[:64])
    trainer = make_trainer(
        [AdaptiveBatch()],
        model=model,
        dataset=dataset,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=32,
    )
    assert trainer._adaptive_batch.controller.size == min(recommended, 64)


@pytest.mark.parametrize(
    "model, options, message",
    [
        ("tiny", "--seq-len 16", "no CUDA device; pass --cpu --memory-budget"),
        ("tiny", "--seq-len 16 --cpu", "--cpu needs --memory-budget"),
        ("/nonexistent", "--seq-len 16 --cpu --memory-budget 1", "does not exist"),
        ("tiny", "--seq-len 4096 --cpu --memory-budget 1", "exceeds the model's max_position"),
        (
            "tiny",
            "--seq-len 16 --cpu --memory-budget 1 --lora-r 4 --lora-target qkv",
            "--lora-target qkv matches no module of this model; its linear layers are",
        ),
        ("tiny", "--seq-len 16 --cpu --memory-budget 1 --headroom 1.5", "--headroom 1.5"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_1(capsys, model_dir, model, options, message):
    if "no CUDA" in message and torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    code, out, err = run_cli(capsys, model_dir if model == "tiny" else model, options)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("adaptive-batch: error:") and message in err


def test_unknown_option_values_exit_through_argparse(capsys, model_dir):
    with pytest.raises(SystemExit) as exit_info:
        main(["probe", str(model_dir), "--seq-len", "16", "--dtype", "fp8"])
    assert exit_info.value.code == 2
