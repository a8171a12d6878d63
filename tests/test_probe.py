"""`probe` and `adaptive-batch probe` on the CPU, against a memory budget (bitsandbytes 4-bit and LoRA included)."""

import gc
import json
import math
import subprocess
import sys

import pytest
import torch

from adaptive_batch import AdaptiveBatch
from adaptive_batch.cli.main import main
from adaptive_batch.probe import load
from adaptive_batch.probe.boundary import split_reason
from adaptive_batch.probe.cache import CachedStart, cached_start, describe_setup, save_report
from adaptive_batch.probe.search import ProbeReport, probe
from adaptive_batch.probe.trials import TrialRunner
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
    report = probe(model, seq_len=16, memory_budget=math.inf, max_size=64, evaluation=False)
    assert watcher.sizes == [1, 2, 4, 8, 6, 5]  # warm-up, 2-4, doubling to the first failure, bisection
    assert report.boundary == 5 and report.first_failing == 6
    assert [t["size"] for t in report.trials] == [2, 4, 5, 6, 8]
    assert report.recommended in (2, 4, 5)


def test_the_eval_batch_is_searched_with_forwards_without_gradients(tokenizer):
    model = tiny_llama(tokenizer)
    grad_enabled = []
    model.register_forward_pre_hook(lambda *args: grad_enabled.append(torch.is_grad_enabled()))
    watcher = FakeOutOfMemory(model, max_rows=5)  # training steps above 5 rows fail
    evaluation = FakeOutOfMemory(model, max_rows=11, in_eval=True)  # any forward above 11 rows fails
    report = probe(model, seq_len=16, memory_budget=math.inf, max_size=64, largest=True)
    assert report.boundary == 5 and report.eval_boundary == 11 and report.eval_first_failing == 12
    assert 6 in watcher.raised and 12 in evaluation.raised  # each search met its own limit
    assert grad_enabled.count(False) == len(report.eval_trials)  # every eval trial, and only those
    assert [t["size"] for t in report.eval_trials][:2] == [2, 4]


def test_the_warm_up_is_one_short_sample_and_every_trial_is_full_length(tokenizer):
    model = tiny_llama(tokenizer)
    watcher = FakeOutOfMemory(model, max_rows=5)
    report = probe(model, seq_len=128, memory_budget=math.inf, max_size=64, evaluation=False)
    assert (watcher.sizes[0], watcher.tokens[0]) == (1, 64) and report.warm_up_tokens == 64
    assert watcher.sizes[1:] == [2, 4, 8, 6, 5]
    assert watcher.tokens[1:] == [size * 128 for size in watcher.sizes[1:]]


def test_the_report_says_where_the_time_went(tokenizer):
    model = tiny_llama(tokenizer)
    FakeOutOfMemory(model, max_rows=5)
    report = probe(model, seq_len=16, memory_budget=math.inf, max_size=64, evaluation=False)
    spent = [(t["forward_seconds"] if t["forward_only"] else t["seconds"]) or 0.0 for t in report.trials]
    assert report.trial_seconds == pytest.approx(sum(spent))
    assert 0 < report.warm_up_seconds and 0 < report.setup_seconds and 0 < report.cleanup_seconds
    # the rest: before the warm-up, after the last trial, and between trials (input batches, releasing memory)
    assert report.setup_seconds + report.cleanup_seconds < report.overhead_seconds < report.seconds


def test_garbage_is_collected_only_after_a_trial_cut_short(tokenizer, monkeypatch):
    collections = []
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(args))
    model = tiny_llama(tokenizer)
    probe(model, seq_len=16, memory_budget=math.inf, max_size=8, largest=True)
    assert collections == []  # every trial ran to the end: nothing left in reference cycles
    FakeOutOfMemory(model, max_rows=5)
    report = probe(model, seq_len=16, memory_budget=math.inf, max_size=64, largest=True)
    assert len(collections) == sum(t["out_of_memory"] for t in report.trials) == 2  # 8 and 6, once each


def test_the_cpu_reading_counts_the_optimizer_state_held_between_steps(tokenizer):
    def peak(momentum: float) -> float:
        model = tiny_llama(tokenizer)
        # one tensor at a time: the update is in place, so the only difference is the momentum buffers held
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum, foreach=False)
        runner = TrialRunner(model, optimizer, 16, model.config.vocab_size, torch.device("cpu"), None, None)
        runner.warm_up()  # momentum SGD makes its buffers here, in the first step
        return runner.run(2).peak_bytes

    buffers = sum(p.numel() * p.element_size() for p in tiny_llama(tokenizer).parameters())
    assert peak(momentum=0.9) - peak(momentum=0.0) == buffers


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
    assert [t["size"] for t in result["trials"]][:2] == [2, 4]
    assert result["boundary_tokens"] == result["boundary"] * 32
    per_device, accumulation = result["per_device_train_batch_size"], result["gradient_accumulation_steps"]
    assert per_device * accumulation == 48 and per_device <= result["recommended"]
    assert result["setup"]["lora"] == {"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}
    assert result["setup"]["quantization"]["load_in_4bit"] == "True"
    assert result["device"] == "cpu" and result["split_reason"] == split_reason(result["recommended"], 48, 1)
    # the eval batch: a forward without gradients needs less than a training step, so more samples fit
    assert result["eval_boundary"] > result["boundary"]
    eval_sizes = {t["size"]: t for t in result["eval_trials"]}
    assert eval_sizes[result["eval_boundary"]]["peak_bytes"] <= limit
    eval_failing = eval_sizes[result["eval_first_failing"]]
    assert eval_failing["out_of_memory"] or eval_failing["peak_bytes"] > limit
    cached = json.loads((probe_cache / result["cache_file"].rsplit("/", 1)[-1]).read_text())
    assert cached["32"]["boundary"] == result["boundary"]


@pytest.mark.parametrize("dtype", [None, torch.float64])
def test_adaptive_batch_starts_at_the_probed_size_or_says_why_not(
    capsys, caplog, make_trainer, tokenizer, tmp_path, fixed_rows, dtype
):
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
    dataset = Dataset.from_list(fixed_rows[:64])  # rows of the probed length
    with caplog.at_level("INFO", logger="adaptive_batch"):
        adaptive = AdaptiveBatch()
        make_trainer(
            [adaptive],
            model=model,
            dataset=dataset,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=32,
            dtype=dtype,  # float64: a setup the probe did not see
        )
    if dtype is None:
        assert adaptive.current()["micro_batch_size"] == min(recommended, 64)
        assert f"at 32 tokens: {recommended} samples per micro-batch" in caplog.text
    else:
        assert adaptive.current()["micro_batch_size"] == 2  # the per-device size
        lines = [
            r.getMessage() for r in caplog.records if "dtype (torch.float32 in the cache" in r.getMessage()
        ]
        assert len(lines) == 1 and "torch.float64 now" in lines[0]


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


def test_cli_text_on_the_cpu_and_why_the_per_device_size_is_below_the_recommendation(capsys, model_dir):
    # the largest size up to 13 that fits a generous budget is 13; 16 samples per step split as 8 x 2
    options = (
        "--seq-len 16 --cpu --memory-budget 1 --dtype fp32 --no-gradient-checkpointing --max --max-size 13 "
        "--effective-batch 16 --no-cache"
    )
    code, out, err = run_cli(capsys, model_dir, options)
    assert code == 0, err
    assert "recommended: 13 (largest that fits)" in out
    assert "eval batch: at least 13 samples fit one forward without gradients" in out  # (--max-size 13)
    assert (
        "for an effective batch of 16 on the CPU: per_device_train_batch_size=8, gradient_accumulation_steps=2\n"
        "  8 x 2: 8 is the largest size up to the recommended 13 that divides the 16 samples per device evenly "
        "(13 would leave a remainder of 3)\n"
    ) in out
    assert "GPU" not in out


@pytest.mark.parametrize("budget", ["0", "-2", "nan", "inf"])
def test_a_memory_budget_no_step_can_run_under_is_refused_before_loading(capsys, monkeypatch, budget):
    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(load, "load_model", must_not_load)
    code, out, err = run_cli(capsys, "/nonexistent", f"--seq-len 16 --cpu --memory-budget {budget}")
    assert code == 1 and out == ""
    assert err == (
        f"adaptive-batch: error: --memory-budget {budget} is not a positive, finite number of GiB (the memory a "
        "training step may use); pass one such as --memory-budget 8.\n"
    )


def test_a_gguf_folder_is_pointed_at_its_conversion(capsys, tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"")
    code, out, err = run_cli(capsys, tmp_path, "--seq-len 16 --cpu --memory-budget 1")
    assert code == 1 and out == "" and err.count("\n") == 1
    assert f"model directory {tmp_path} holds model.gguf (GGUF) and no config.json; convert it once" in err
    assert (
        f"AutoModelForCausalLM.from_pretrained('{tmp_path}', gguf_file='model.gguf', dtype=torch.bfloat16); "
        "model.config.quantization_config = None (if it is set); model.save_pretrained(OUT); then probe OUT."
    ) in err


def test_a_folder_without_config_json_is_one_line(capsys, tmp_path):
    code, out, err = run_cli(capsys, tmp_path, "--seq-len 16 --cpu --memory-budget 1")
    assert code == 1 and err.count("\n") == 1
    assert (
        f"model directory {tmp_path} holds no config.json; pass a folder written by save_pretrained." in err
    )


# -- the cache ---------------------------------------------------------------------------------------------------

SETUP = {
    "model": {"hidden_size": 4096, "num_hidden_layers": 32},
    "dtype": "torch.bfloat16",
    "quantization": None,
    "lora": {"r": 16, "alpha": 32, "targets": ["q_proj", "v_proj"]},
    "gradient_checkpointing": True,
    "optim": "paged_adamw_8bit",
    "device": "NVIDIA H200",
    "versions": {"torch": "2.11.0", "transformers": "5.17.0"},
}


def cache(setup: dict, seq_len: int, recommended: int) -> None:
    report = ProbeReport(setup, seq_len, None, [], 2 * recommended, None, None, recommended, "", 0)
    save_report(report)


def test_the_cache_gives_the_entry_of_the_shortest_length_that_covers_the_run():
    cache(SETUP, 1024, recommended=13)
    cache(SETUP, 4096, recommended=3)
    message = (
        'adaptive-batch probe\'s choice for this setup at 1,024 tokens: 13 samples per micro-batch; "auto" starts '
        "from it, at most what a step holds (the plan table says where)."
    )
    assert cached_start(SETUP, 512) == CachedStart(13, 1024, message)
    assert cached_start(SETUP, 2048).size == 3


def test_an_empty_cache_says_nothing():
    assert cached_start(SETUP, 1024) == CachedStart(None, None, None)


def test_a_setup_not_in_the_cache_names_what_differs_from_the_nearest_cached_one():
    cache(SETUP, 1024, recommended=13)
    other_model = {**SETUP, "model": {"hidden_size": 64, "num_hidden_layers": 2}, "optim": "adamw_torch"}
    cache(other_model, 1024, recommended=50)
    now = {**SETUP, "dtype": "torch.float32", "lora": {**SETUP["lora"], "r": 8}}
    assert cached_start(now, 1024) == CachedStart(
        None,
        None,
        "adaptive-batch probe's cache holds no entry for this setup; the nearest cached setup differs in dtype "
        "(torch.bfloat16 in the cache, torch.float32 now); lora.r (16 in the cache, 8 now): re-run "
        "`adaptive-batch probe` for this setup to start from a probed micro-batch.",
    )
    # a model the cache holds nothing for: nothing to say (the cache of other models is not news)
    third_model = {**now, "model": {"hidden_size": 32, "num_hidden_layers": 2}}
    assert cached_start(third_model, 1024) == CachedStart(None, None, None)


def test_a_setup_probed_at_shorter_sequences_says_how_long():
    cache(SETUP, 1024, recommended=13)
    assert cached_start(SETUP, 4096) == CachedStart(
        None,
        None,
        "adaptive-batch probe's cache holds this setup up to 1,024 tokens, and this run needs 4,096: re-run "
        "`adaptive-batch probe` with --seq-len 4096.",
    )


def test_a_stated_micro_batch_or_eval_batch_above_the_probed_boundary_is_warned(make_trainer, caplog):
    trainer = make_trainer([AdaptiveBatch(micro_batch_size=8)], per_device_eval_batch_size=16, max_steps=1)
    setup = describe_setup(trainer.model, trainer.args.optim, bool(trainer.args.gradient_checkpointing))
    # the probe saw 5 rows fail in training and 9 in evaluation, at 512 tokens (the run's rows are shorter)
    save_report(
        ProbeReport(setup, 512, None, [], 4, 5, None, 4, "", 0, eval_boundary=8, eval_first_failing=9)
    )
    with caplog.at_level("WARNING", logger="adaptive_batch"):
        trainer.train()
    assert (
        "micro_batch_size=8 is above the largest micro-batch adaptive-batch probe found to fit for this setup at "
        "512 tokens (4): the first step will run out of memory and run again smaller. Set micro_batch_size=4, or "
        "'auto' to start from the probe's choice."
    ) in caplog.text
    assert (
        "per_device_eval_batch_size=16 is above the largest eval batch adaptive-batch probe found to fit for this "
        "setup at 512 tokens (8)"
    ) in caplog.text
    # where no size failed, the boundary is a lower bound: nothing to warn about
    caplog.clear()
    save_report(ProbeReport(setup, 512, None, [], 4, None, None, 4, "", 0, eval_boundary=8))
    again = make_trainer([AdaptiveBatch(micro_batch_size=8)], per_device_eval_batch_size=16, max_steps=1)
    with caplog.at_level("WARNING", logger="adaptive_batch"):
        again.train()
    assert "adaptive-batch probe found to fit" not in caplog.text


def test_the_cache_module_imports_neither_the_trials_nor_model_loading():
    code = (
        "import sys, adaptive_batch.probe.cache; "
        "print(sorted(m for m in ('adaptive_batch.probe.trials', 'adaptive_batch.probe.load', 'adaptive_batch.probe.search') "
        "if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_throughput_confirmation_runs_the_forward_pass_only(tokenizer, monkeypatch):
    import adaptive_batch.probe.search as probe_module

    proposals = iter([3])  # after the search, confirm size 3 (a size the search did not try), then stop
    monkeypatch.setattr(probe_module, "next_throughput_size", lambda trials, limit: next(proposals, None))
    model = tiny_llama(tokenizer)
    watcher = FakeOutOfMemory(model, max_rows=5)
    backwards = []
    model.lm_head.weight.register_hook(lambda grad: backwards.append(len(watcher.sizes)))
    report = probe(model, seq_len=16, memory_budget=math.inf, max_size=64, evaluation=False)
    # warm-up, 2, 4, 8 and 6 (out of memory in the forward), 5, then 3: its forward alone, no backward
    assert watcher.sizes == [1, 2, 4, 8, 6, 5, 3]
    assert backwards == [1, 2, 3, 6]  # the forwards seen when each backward ran
    confirmed = next(t for t in report.trials if t["size"] == 3)
    assert confirmed["forward_only"] and confirmed["fits"]  # below the boundary (5), whose whole step fitted
    boundary = next(t for t in report.trials if t["size"] == 5)
    ratio = boundary["seconds"] / boundary["forward_seconds"]
    assert confirmed["seconds"] == pytest.approx(confirmed["forward_seconds"] * ratio)
    assert 0 < boundary["forward_seconds"] < boundary["seconds"]


@pytest.mark.parametrize(
    "first_failing, boundary_line",
    [(None, "at least 256 samples (at least 8,192 tokens)"), (300, "boundary: 256 samples (8,192 tokens)")],
)
def test_the_report_says_at_least_where_no_trial_failed_and_shows_a_small_limit(
    capsys, first_failing, boundary_line
):
    from adaptive_batch.cli.probe import show

    report = ProbeReport(
        SETUP, 32, 0.0001 * 2**30, [], 256, first_failing, None, 256, "largest that fits", 8192
    )
    show(report.to_dict())
    out = capsys.readouterr().out
    assert boundary_line in out
    assert "limit 0.0001 GiB" in out  # not "0.00"
