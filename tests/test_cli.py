import json

import pytest

from adaptive_batch.cli.main import main
from adaptive_batch.cli.probe import devices_text
from adaptive_batch.core import config
from adaptive_batch.core.controllers import FLEX_OVER_ROWS
from adaptive_batch.core.planning import RunSettings, plan_run
from adaptive_batch.core.schedule import PhaseSchedule


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_json_counts_steps_samples_and_the_lr_of_each_phase(capsys):
    code, out, err = run(
        capsys,
        "plan",
        "--dataset-size",
        "1000",
        "--per-device",
        "4",
        "--accumulation",
        "2",
        "--gpus",
        "2",
        "--epochs",
        "2",
        "--schedule",
        "16,32,64",
        "--boundaries",
        "0.25,0.5",
        "--lr-scaling",
        "sqrt",
        "--json",
    )
    assert code == 0 and err == ""
    result = json.loads(out)
    assert result["starting_effective_batch_size"] == 16
    assert result["samples"] == result["budget_samples"] == 2000
    assert [p["effective_batch_size"] for p in result["phases"]] == [16, 32, 64]
    assert [p["lr_multiplier"] for p in result["phases"]] == pytest.approx([1.0, 2**0.5, 2.0])
    assert [p["per_device_samples"] for p in result["phases"]] == [8, 16, 32]
    # 512 samples at 16 (the phase ends at 500, inside step 31), 488 at 32 (15 steps and 8), 1000 at 64 (15 and 40)
    assert result["optimizer_steps"] == 32 + 16 + 16
    # the base LR schedule's length is the plain Trainer's steps at 16: 63 an epoch (62 of 16 and one of 8)
    assert result["lr_schedule_steps"] == 2 * 63
    # each epoch ends with a short step (8 of 32, 40 of 64); the rule applies to the samples it holds
    assert result["uneven_steps"] == [
        {"step": 47, "samples": 8, "scheduled": 32, "lr_multiplier": pytest.approx(0.5**0.5)},
        {"step": 63, "samples": 40, "scheduled": 64, "lr_multiplier": pytest.approx(2.5**0.5)},
    ]


def test_plan_table_and_the_max_steps_traps(capsys):
    code, out, err = run(
        capsys,
        "plan",
        "--dataset-size",
        "1000",
        "--max-steps",
        "100",
        "--epochs",
        "2",
        "--per-device",
        "8",
        "--schedule",
        "8,32",
        "--boundaries",
        "0.5",
    )
    assert code == 0
    assert "AdaptiveBatch plan" in out and "optimizer steps" in out
    assert "max_steps=100 and num_train_epochs=2 are both set" in err
    assert "counts it as 800 samples" in err and "runs 63 optimizer steps" in err


@pytest.mark.parametrize(
    "argv, padding_free, starts, switch",
    [
        # the default: padded on the first step (padding-free in rows from the second, where lengths vary)
        ([], False, "padded, without the padding mask: a causal LM's right-padded rows", True),
        (
            ["--attention", "eager"],
            False,
            "padded until the first step tells the rows' lengths; padding-free in",
            True,
        ),
        (
            ["--attention", "flex_attention"],
            False,
            "padded until the first step tells the rows' lengths",
            False,
        ),
        # TRL's packing flattens batches itself
        (["--", "--packing"], False, "padding-free: the collator flattens", False),
    ],
    ids=["sdpa", "eager", "flex", "trl-packing"],
)
def test_plan_says_the_layout_and_what_flex_attention_would_give(capsys, argv, padding_free, starts, switch):
    code, out, _ = run(capsys, "plan", "--dataset-size", "100", "--json", *argv)
    assert code == 0
    layout = json.loads(out)["layout"]
    assert layout["padding_free"] is padding_free and layout["text"].startswith(starts)
    # how to switch, and the estimated gain, only where switching would change the layout
    assert ('attn_implementation="flex_attention"' in layout["text"]) is switch
    low, high = FLEX_OVER_ROWS
    assert (f"an estimated {low:.2f}-{high:.2f}x the real tokens/s" in layout["text"]) is switch
    code, out, _ = run(capsys, "plan", "--dataset-size", "100", *argv)
    # the table's row (rich wraps its text)
    (row,) = [line for line in out.splitlines() if line.lstrip("│ ").startswith("layout ")]
    assert starts.split()[0] in row


def test_plan_reads_token_counts_from_a_jsonl_dataset(capsys, tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps({"input_ids": list(range(n))}) for n in (10, 20, 30, 40)))
    code, out, _ = run(
        capsys, "plan", "--dataset", str(path), "--per-device", "2", "--epochs", "1.5", "--json"
    )
    result = json.loads(out)
    assert result["dataset_size"] == 4 and result["tokens"] == 150  # 100 tokens an epoch, 1.5 epochs


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--dataset-size", "100", "--gpus", "3", "--schedule", "8"],
            "not divisible by world_size=3: every rank must take the same share. Use 6 or 9",
        ),
        (
            ["--dataset-size", "100", "--schedule", "8,x", "--boundaries", "0.5"],
            "--schedule item 'x' is not an integer",
        ),
        (["--dataset-size", "100", "--boundaries", "0.5"], "--boundaries needs --schedule"),
        (["--dataset", "/nonexistent.jsonl"], "does not exist"),
        (
            ["--dataset-size", "10", "--schedule", "16"],
            "exceeds the dataset size 10 samples: one optimizer step cannot hold more than one epoch. Give the "
            "schedule sizes of at most 10 there, or use a larger dataset.",
        ),
    ],
)
def test_bad_input_is_one_line_and_a_non_zero_exit(capsys, argv, message):
    code, out, err = run(capsys, "plan", *argv)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("adaptive-batch: error:") and message in err


def test_unknown_option_values_exit_through_argparse(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--dataset-size", "100", "--lr-scaling", "cubic"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'cubic'" in capsys.readouterr().err


def test_plan_reads_token_counts_from_a_saved_dataset(capsys, tmp_path):
    from datasets import Dataset

    Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6]]}).save_to_disk(str(tmp_path / "saved"))
    code, out, _ = run(
        capsys, "plan", "--dataset", str(tmp_path / "saved"), "--per-device", "1", "--epochs", "2", "--json"
    )
    assert code == 0 and json.loads(out)["tokens"] == 12


def option_entries(help_text: str) -> dict[str, str]:
    """`{option: its help text}` from the options section of a `--help` output (one entry per option)."""
    entries: dict[str, str] = {}
    section = help_text.split("options:", 1)[1]
    option = None
    for line in section.splitlines():
        if line.startswith("  -"):
            invocation, _, help_start = line.strip().partition("  ")
            option = [word for word in invocation.replace(",", " ").split() if word.startswith("-")][-1]
            entries[option] = help_start.strip()
        elif option is not None and line.strip():
            entries[option] = f"{entries[option]} {line.strip()}".strip()
    return entries


@pytest.mark.parametrize(
    "command, defaults",
    [
        (
            "probe",
            {"--dtype": "bf16", "--lora-target": "q_proj,v_proj", "--gpus": "1", "--headroom": "0.05"},
        ),
        (
            "plan",
            {
                "--per-device": "--args, else 8",
                "--accumulation": "--args, else 1",
                "--gpus": "1",
                "--unit": "fraction",
                "--lr-scaling": "none",
            },
        ),
        ("plot", {}),  # --out's default depends on RUN_DIR, so its help states it
    ],
)
def test_help_explains_every_option_and_shows_its_default(capsys, monkeypatch, command, defaults):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    entries = option_entries(capsys.readouterr().out)
    assert "--json" in entries and all(entries.values()), {o: h for o, h in entries.items() if not h}
    for option, default in defaults.items():
        assert entries[option].endswith(f"(default: {default})"), entries[option]
    assert "(default: None)" not in " ".join(entries.values())


def test_options_that_are_adaptive_batch_settings_show_the_config_s_help(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    entries = option_entries(capsys.readouterr().out)

    def words(text):  # --help wraps lines (and may break after a hyphen): compare without the whitespace
        return "".join(text.split())

    # what the setting is, in the config's words (the start of its help), then the values in the command line's
    # syntax, never Python's
    assert words(entries["--lr-scaling"]) == words(
        f"{config.meaning('lr_scaling')}: none (unchanged), sqrt (Adam family: x sqrt(B / B0), B the effective "
        "batch, B0 the starting one) or linear (SGD: x B / B0) (default: none)"
    )
    assert words(entries["--schedule"]).startswith(
        words(
            f"{config.meaning('schedule')}: the size of each phase, comma-separated, e.g. 8,16,32 with --boundaries"
        )
    )
    for option in ("--lr-scaling", "--schedule"):
        for python in ("`", "NoiseScaleSchedule", "PhaseSchedule", "callable", "sqrt_gain", "'gain'", "None"):
            assert python not in entries[option], (option, python)
    for name in ("lr_scaling", "schedule"):
        assert (
            config.AdaptiveBatchConfig.__dataclass_fields__[name]
            .metadata["help"]
            .startswith(config.meaning(name) + ":")
        )


@pytest.mark.parametrize(
    "argv, schedule, settings",
    [
        (
            ["--dataset-size", "1000", "--gpus", "2", "--epochs", "2", "--drop-last"],
            PhaseSchedule([16, 32, 64], [0.25, 0.5]),
            RunSettings(1000, num_train_epochs=2.0, world_size=2, drop_last=True),
        ),
        (
            ["--dataset-size", "1000", "--gpus", "2", "--max-steps", "50"],
            PhaseSchedule([16, 32, 64], [0.25, 0.5]),
            RunSettings(1000, max_steps=50, world_size=2),
        ),
    ],
)
def test_plan_prints_what_plan_run_plans_for_the_trainer(capsys, argv, schedule, settings):
    """The command and the Trainer path plan through the same function, so they agree to the step."""
    code, out, err = run(
        capsys,
        "plan",
        *argv,
        "--schedule",
        "16,32,64",
        "--boundaries",
        "0.25,0.5",
        "--lr-scaling",
        "sqrt",
        "--json",
    )
    assert code == 0, err
    result = json.loads(out)
    expected = plan_run(schedule, settings, "sqrt")
    assert result["optimizer_steps"] == expected.plan.num_steps
    assert result["budget_samples"] == expected.budget.samples
    assert result["budget_origin"] == expected.budget.origin
    assert result["samples"] == expected.plan.num_samples
    assert result["starting_effective_batch_size"] == expected.starting_effective_batch_size
    assert result["lr_schedule_steps"] == expected.clock.nominal_steps
    assert [(p["first_step"], p["last_step"], p["effective_batch_size"]) for p in result["phases"]] == list(
        expected.plan.phases()
    )
    assert [p["lr_multiplier"] for p in result["phases"]] == [
        expected.clock.multiplier(effective) for _, _, effective in expected.plan.phases()
    ]
    assert [(s["step"], s["samples"], s["lr_multiplier"]) for s in result["uneven_steps"]] == [
        (step, samples, expected.clock.scale(step)) for step, samples, _ in expected.plan.uneven_steps()
    ]


@pytest.mark.parametrize(
    "device, gpus, text",
    [("cpu", 1, "the CPU"), ("cpu", 2, "2 CPU processes"), ("cuda", 1, "1 GPU"), ("cuda", 8, "8 GPUs")],
)
def test_what_the_effective_batch_is_shared_across_in_words(device, gpus, text):
    assert devices_text(device, gpus) == text


@pytest.mark.parametrize("saved_as", ["json", "bin"])
def test_plan_reads_the_run_s_saved_training_arguments(capsys, tmp_path, saved_as):
    """The settings come from the run's own TrainingArguments (a JSON of them, or a checkpoint's
    training_args.bin); a flag given on the command line wins."""
    import torch
    from transformers import TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=3,
        num_train_epochs=2,
        dataloader_drop_last=True,
        use_cpu=True,
        report_to=[],
    )
    path = tmp_path / ("args.json" if saved_as == "json" else "training_args.bin")
    if saved_as == "json":
        path.write_text(args.to_json_string())
    else:
        torch.save(args, path)
    code, out, err = run(capsys, "plan", "--dataset-size", "100", "--args", str(path), "--json")
    assert code == 0, err
    result = json.loads(out)
    # 12 a step, 2 epochs of 100; the short last step of each epoch (4) dropped
    assert result["starting_effective_batch_size"] == 12 and result["budget_samples"] == 200
    assert result["optimizer_steps"] == 2 * 8 and result["samples"] == 2 * 96
    code, out, _ = run(
        capsys, "plan", "--dataset-size", "100", "--args", str(path), "--per-device", "5", "--json"
    )
    assert json.loads(out)["starting_effective_batch_size"] == 15  # 5 x the file's 3


def test_plan_reads_the_scripts_own_arguments_after_a_double_dash(capsys, tmp_path):
    script = [
        "--model_name_or_path",
        "m",
        "--per_device_train_batch_size",
        "4",
        "--gradient-accumulation-steps=3",
    ]
    script += ["--num_train_epochs", "2", "--dataloader_drop_last", "--learning_rate", "2e-4"]
    code, out, err = run(capsys, "plan", "--dataset-size", "100", "--json", "--", *script)
    assert code == 0, err
    result = json.loads(
        out
    )  # as the saved arguments above: 12 a step, the short last step of each epoch dropped
    assert result["starting_effective_batch_size"] == 12 and result["budget_samples"] == 200
    assert result["samples"] == 2 * 96
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 5}))
    code, out, _ = run(
        capsys,
        "plan",
        "--dataset-size",
        "100",
        "--args",
        str(path),
        "--json",
        "--",
        "--per_device_train_batch_size",
        "7",
    )
    assert json.loads(out)["starting_effective_batch_size"] == 35  # the script's 7 over the file's 2, x its 5


def test_plan_refuses_a_file_that_holds_no_training_arguments(capsys, tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"learning_rate": 1e-4}))
    code, _, err = run(capsys, "plan", "--dataset-size", "100", "--args", str(path))
    assert code == 1 and "holds no TrainingArguments (no per_device_train_batch_size)" in err
    code, _, err = run(capsys, "plan", "--dataset-size", "100", "--args", str(tmp_path / "missing.json"))
    assert code == 1 and "does not exist" in err


def test_plan_counts_text_tokens_with_a_tokenizer_folder(capsys, tmp_path, tokenizer, texts):
    folder = tmp_path / "tokenizer"
    tokenizer.save_pretrained(folder)
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps({"text": text}) for text in texts[:10]))
    # as SFTTrainer tokenises text rows (the only trainer that does): each text with the EOS it appends
    expected = sum(len(tokenizer(text + tokenizer.eos_token)["input_ids"]) for text in texts[:10])
    code, out, err = run(
        capsys, "plan", "--dataset", str(path), "--tokenizer", str(folder), "--epochs", "2", "--json"
    )
    assert code == 0, err
    assert json.loads(out)["tokens"] == 2 * expected
    code, out, _ = run(capsys, "plan", "--dataset", str(path), "--epochs", "2", "--json")
    assert json.loads(out)["tokens"] is None  # no tokenizer: not known
    path.write_text(json.dumps({"prompt": "no text field"}))
    code, _, err = run(capsys, "plan", "--dataset", str(path), "--tokenizer", str(folder))
    assert code == 1 and "row 0 holds neither 'input_ids', 'text' (dataset_text_field), 'messages' nor" in err


def chat_tokenizer_folder(tokenizer, folder):
    """The test tokenizer with a chat template, saved as a chat model's tokenizer folder."""
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(folder)
    chat = AutoTokenizer.from_pretrained(folder)
    chat.chat_template = "{% for m in messages %}<eos>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    chat.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def test_plan_counts_chat_tokens_through_the_template(capsys, tmp_path, tokenizer, texts):
    """Each conversation counts the tokens of its rendered template, not the keys of the BatchEncoding that
    apply_chat_template(tokenize=True) returns in transformers 5 (which counted 2 a conversation)."""
    chat = chat_tokenizer_folder(tokenizer, tmp_path / "tokenizer")
    conversations = [
        [{"role": "user", "content": texts[i]}, {"role": "assistant", "content": texts[i + 1]}]
        for i in range(0, 20, 2)
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": messages}) for messages in conversations))
    expected = sum(
        len(chat.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
        for messages in conversations
    )
    assert expected > 20 * len(conversations)  # real text: far more than 2 tokens a conversation
    code, out, err = run(
        capsys,
        "plan",
        "--dataset",
        str(path),
        "--tokenizer",
        str(tmp_path / "tokenizer"),
        "--per-device",
        "2",
        "--epochs",
        "2",
        "--json",
    )
    assert code == 0, err
    assert json.loads(out)["tokens"] == 2 * expected


def test_plan_refuses_chat_rows_with_a_tokenizer_without_a_chat_template(capsys, tmp_path, tokenizer):
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hello"}]}))
    code, _, err = run(capsys, "plan", "--dataset", str(path), "--tokenizer", str(tmp_path / "tokenizer"))
    assert code == 1 and "row 0 holds 'messages' but the --tokenizer has no chat_template" in err


def plan_warnings(capsys, *argv) -> list[str]:
    capsys.readouterr()  # what came before (a Trainer's progress, a library's import notice) is not the plan's
    code, out, err = run(capsys, "plan", "--json", *argv)  # (before the argv: it may end with -- SCRIPT ARGS)
    assert code == 0, err
    return json.loads(out)["warnings"]


def test_a_batch_above_the_dataset_plans_an_epoch_a_step_and_warns(capsys):
    argv = [
        "--dataset-size",
        "40",
        "--per-device",
        "16",
        "--accumulation",
        "2",
        "--gpus",
        "2",
        "--epochs",
        "3",
    ]
    assert plan_warnings(capsys, *argv) == [
        "per_device_train_batch_size=16 x gradient_accumulation_steps=2 x 2 processes = 64 samples a step is more "
        "than the dataset's 40 samples: each optimizer step takes one whole epoch (40), as the plain Trainer's does. "
        "Make that product at most the dataset size for steps of the size you set."
    ]
    code, out, _ = run(capsys, "plan", "--json", *argv)
    assert json.loads(out)["optimizer_steps"] == 3


def test_max_steps_in_a_saved_training_arguments_does_not_warn_of_the_default_epochs(capsys, tmp_path):
    """A saved TrainingArguments holds num_train_epochs=3 whether or not it was set: only an explicit one is warned
    about as overridden by max_steps."""
    from transformers import TrainingArguments

    path = tmp_path / "args.json"
    saved = TrainingArguments(output_dir=str(tmp_path), max_steps=7, use_cpu=True, report_to=[])
    path.write_text(saved.to_json_string())
    assert json.loads(path.read_text())["num_train_epochs"] == 3
    assert plan_warnings(capsys, "--dataset-size", "100", "--args", str(path)) == []
    # given on purpose (a flag, the script's own arguments, or a saved value other than 3): warned
    for extra in (["--epochs", "3"], ["--", "--num_train_epochs", "3"]):
        warnings = plan_warnings(capsys, "--dataset-size", "100", "--args", str(path), *extra)
        assert warnings == [
            "max_steps=7 and num_train_epochs=3 are both set: max_steps wins and num_train_epochs is ignored, as in "
            "the Trainer. Set only one of them."
        ]
    path.write_text(json.dumps({**json.loads(saved.to_json_string()), "num_train_epochs": 2}))
    assert (
        "num_train_epochs=2 are both set"
        in plan_warnings(capsys, "--dataset-size", "100", "--args", str(path))[0]
    )


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"gradient_accumulation_steps": "two"},
            "gives gradient_accumulation_steps='two', which is not a positive int; use e.g. "
            '"gradient_accumulation_steps": 4, or override it with --accumulation 4.',
        ),
        ({"per_device_train_batch_size": 0}, "per_device_train_batch_size=0, which is not a positive int"),
        (
            {"per_device_train_batch_size": 2.5},
            "per_device_train_batch_size=2.5, which is not a positive int",
        ),
        ({"num_train_epochs": "3"}, "num_train_epochs='3', which is not a number >= 0"),
        ({"max_steps": 1.5}, "max_steps=1.5, which is not an int (-1: not set)"),
        ({"dataloader_drop_last": "yes"}, "dataloader_drop_last='yes', which is not true or false"),
    ],
)
def test_bad_saved_training_arguments_name_the_field_the_rule_and_a_fix(capsys, tmp_path, fields, message):
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"per_device_train_batch_size": 2, **fields}))
    code, out, err = run(capsys, "plan", "--dataset-size", "100", "--args", str(path))
    assert code == 1 and out == "" and err.count("\n") == 1
    assert err.startswith(f"adaptive-batch: error: --args {path} gives ") and message in err


def test_bad_script_arguments_name_the_field(capsys):
    code, _, err = run(capsys, "plan", "--dataset-size", "100", "--", "--gradient_accumulation_steps", "two")
    assert code == 1 and err.count("\n") == 1
    assert (
        "the script arguments after -- give gradient_accumulation_steps='two', which is not a positive int"
        in err
    )
    assert "--gradient_accumulation_steps 4" in err


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--per-device", "abc", "argument --per-device: 'abc' is not a positive int, e.g. --per-device 8"),
        ("--accumulation", "0", "argument --accumulation: '0' is not a positive int, e.g. --accumulation 4"),
        (
            "--dataset-size",
            "1e3",
            "argument --dataset-size: '1e3' is not a positive int, e.g. --dataset-size 1000",
        ),
        ("--epochs", "three", "argument --epochs: 'three' is not a positive number, e.g. --epochs 3"),
        ("--max-steps", "1.5", "argument --max-steps: '1.5' is not an int, e.g. --max-steps 500"),
    ],
)
def test_bad_option_values_name_the_option_the_rule_and_an_example(capsys, option, value, message):
    argv = ["plan", option, value] + ([] if option == "--dataset-size" else ["--dataset-size", "100"])
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "_int value" not in err


@pytest.mark.parametrize(
    "unit, value, message",
    [
        (
            "steps",
            "0.5",
            "--boundaries item '0.5' is not a positive int, as --unit steps needs (optimizer steps",
        ),
        (
            "samples",
            "-40",
            "--boundaries item '-40' is not a positive int, as --unit samples needs (samples seen)",
        ),
        ("fraction", "half", "--boundaries item 'half' is not a number"),
    ],
)
def test_boundaries_in_steps_or_samples_must_be_positive_ints(capsys, unit, value, message):
    code, out, err = run(
        capsys, "plan", "--dataset-size", "100", "--schedule", "8,16", "--boundaries", value, "--unit", unit
    )
    assert code == 1 and out == "" and err.count("\n") == 1 and message in err
    assert "--unit fraction" in err or unit == "fraction"


def test_an_ordinary_plan_has_no_warnings(capsys):
    assert plan_warnings(capsys, "--dataset-size", "1000", "--per-device", "4", "--accumulation", "2") == []
    argv = ["--dataset-size", "1000", "--per-device", "8", "--schedule", "8,16,32", "--boundaries", "0.1,0.3"]
    assert plan_warnings(capsys, *argv) == []


@pytest.mark.parametrize(
    "schedule, boundaries, unit, where",
    [
        ("4,8", "100", "steps", "its first boundary is at 100 steps but its last step is step 24"),
        (
            "4,8",
            "1000",
            "samples",
            "its first boundary is at 1000 samples but its last step starts at 96 samples",
        ),
        (
            "50,100",
            "0.99",
            "fraction",
            "its first boundary is at 0.99 fraction but its last step starts at fraction",
        ),
    ],
)
def test_a_schedule_that_never_leaves_its_first_phase_is_warned(capsys, schedule, boundaries, unit, where):
    warnings = plan_warnings(
        capsys, "--dataset-size", "100", "--epochs", "1", "--per-device", schedule.split(",")[0],
        "--schedule", schedule, "--boundaries", boundaries, "--unit", unit,
    )  # fmt: skip
    assert len(warnings) == 1 and warnings[0].startswith(
        "The schedule never leaves its first phase within the budget"
    )
    size = schedule.split(",")[0]
    assert where in warnings[0] and f"every step trains at {size}" in warnings[0]
    assert "lower the boundaries" in warnings[0] and "raise num_train_epochs / max_steps" in warnings[0]


def test_a_boundary_never_reached_is_warned(capsys):
    # 5 steps of 4 (20 samples), then 10 of 8: 15 steps, so step 50 is never reached and 16 never used
    warnings = plan_warnings(
        capsys, "--dataset-size", "100", "--epochs", "1", "--per-device", "4",
        "--schedule", "4,8,16", "--boundaries", "5,50", "--unit", "steps",
    )  # fmt: skip
    assert warnings == [
        "The schedule boundary 50 steps is never reached within the budget: its last step is step 14 (steps counted "
        "from 0), so the effective batch 16 is never used. To reach it, lower the boundaries to at most 14 steps "
        "(fewer still where the batch grows earlier: larger steps take the budget in fewer of them), give them as "
        "fractions of the budget (unit 'fraction'), or raise num_train_epochs / max_steps."
    ]


def test_a_budget_in_epochs_that_ends_mid_epoch_is_warned(capsys):
    warnings = plan_warnings(capsys, "--dataset-size", "100", "--per-device", "10", "--epochs", "2.5")
    assert warnings == [
        "num_train_epochs=2.5 ends the run mid-epoch: the last epoch trains on 50 of its 100 samples, so 50% of the "
        "data is seen once fewer than the rest. Use a whole number of epochs (num_train_epochs=2 or 3), or max_steps "
        "for a budget in steps."
    ]
    # a budget in max_steps ends where it ends; whole epochs end on an epoch boundary
    assert plan_warnings(capsys, "--dataset-size", "100", "--per-device", "10", "--max-steps", "25") == []
    assert plan_warnings(capsys, "--dataset-size", "100", "--per-device", "10", "--epochs", "2") == []


def test_an_effective_batch_above_the_dataset_size_is_warned_before_it_is_reached(capsys):
    warnings = plan_warnings(
        capsys, "--dataset-size", "100", "--epochs", "1", "--per-device", "4",
        "--schedule", "4,200", "--boundaries", "1000", "--unit", "samples",
    )  # fmt: skip
    assert warnings[-1] == (
        "The schedule's effective batch 200 is above the dataset's 100 samples: one optimizer step cannot hold more "
        "than one epoch, so the run is refused if it reaches that phase (a larger budget, or a resume with more "
        "epochs). Give the schedule sizes of at most 100."
    )
    # reached, the plan refuses it outright
    code, _, err = run(capsys, "plan", "--dataset-size", "100", "--schedule", "4,200", "--boundaries", "0.5")
    assert code == 1 and "exceeds the dataset size 100" in err


def test_a_start_that_disagrees_with_the_batch_settings_is_warned(capsys, tmp_path):
    argv = ["--dataset-size", "1000", "--schedule", "16,32", "--boundaries", "0.5"]
    warnings = plan_warnings(capsys, *argv, "--per-device", "4", "--accumulation", "2")
    assert warnings == [
        "The schedule starts at 16 samples a step but per_device_train_batch_size=4 x gradient_accumulation_steps=2 "
        "x 1 process = 8: the schedule wins, so the run starts at 16, and max_steps and the LR schedule's length "
        "count steps of 16, not the plain Trainer's steps of 8. Make per_device_train_batch_size x "
        "gradient_accumulation_steps x world size 16, or start the schedule at 8."
    ]
    assert plan_warnings(capsys, *argv, "--per-device", "8", "--accumulation", "2") == []  # 8 x 2 = 16
    assert plan_warnings(capsys, *argv) == []  # the batch settings defaulted: nothing to disagree with
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}))
    assert len(plan_warnings(capsys, *argv, "--args", str(path))) == 1  # the run's own settings


def test_the_trainer_logs_the_warnings_plan_prints(make_trainer, caplog, capsys):
    """The callback warns of the same traps as `adaptive-batch plan`, from the same plan, when training starts."""
    from adaptive_batch import AdaptiveBatch

    # 8 = 4 x 2 a step by the Trainer's settings, a schedule from 4 whose boundary is past the run's 10 steps
    trainer = make_trainer(
        [AdaptiveBatch(schedule=PhaseSchedule([4, 8], boundaries=[100], unit="steps"))], num_rows=40
    )
    with caplog.at_level("INFO", logger="adaptive_batch"):
        trainer.train()
    logged = [
        r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name == "adaptive_batch"
    ]
    printed = plan_warnings(
        capsys, "--dataset-size", "40", "--epochs", "1", "--per-device", "4", "--accumulation", "2",
        "--schedule", "4,8", "--boundaries", "100", "--unit", "steps",
    )  # fmt: skip
    assert len(printed) == 2 and printed[0].startswith("The schedule never leaves its first phase")
    assert "The schedule starts at 4 samples a step" in printed[1]
    assert logged == printed
    assert trainer.state.global_step == 10  # warned, not refused


@pytest.mark.parametrize("epochs, warned", [(3, False), (2, True)])
def test_the_trainer_warns_of_max_steps_over_epochs_only_where_they_differ_from_the_default(
    make_trainer, caplog, epochs, warned
):
    from adaptive_batch import AdaptiveBatch

    trainer = make_trainer([AdaptiveBatch()], max_steps=2, num_train_epochs=epochs)
    with caplog.at_level("INFO", logger="adaptive_batch"):
        trainer.train()
    logged = [
        r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name == "adaptive_batch"
    ]
    assert [message.split(":")[0] for message in logged] == (
        [f"max_steps=2 and num_train_epochs={epochs} are both set"] if warned else []
    )
