"""Loading a model for `adaptive-batch probe` the way a QLoRA run would. The inputs are checked before any weight
is read (the folder, its `config.json`, the sequence length, the LoRA targets), each with one clear error."""

from __future__ import annotations

from pathlib import Path

import torch


def load_model(
    model_dir: str,
    dtype: torch.dtype,
    load_in_4bit: bool,
    lora_r: int | None,
    lora_alpha: int | None,
    lora_targets: list[str] | None,
    gradient_checkpointing: bool,
    seq_len: int,
    device: torch.device,
):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(model_dir)
    check_model_dir(path)
    config = AutoConfig.from_pretrained(path)
    longest = getattr(config, "max_position_embeddings", None)
    if longest and seq_len > longest:
        raise ValueError(
            f"--seq-len {seq_len} exceeds the model's max_position_embeddings={longest}; use --seq-len {longest} "
            "or less."
        )
    if lora_r:
        _check_lora_targets(config, lora_targets or [])
    kwargs = {"dtype": dtype}
    if load_in_4bit:
        from transformers import BitsAndBytesConfig

        kwargs["device_map"] = {"": "cpu" if device.type == "cpu" else device.index or 0}
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model.config.use_cache = False
    if load_in_4bit:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    else:
        model.to(device)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora_r:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=lora_r, lora_alpha=lora_alpha or 2 * lora_r, target_modules=lora_targets, task_type="CAUSAL_LM"
        )
        model = get_peft_model(model, lora)
    return model


def check_model_dir(path: Path) -> None:
    """Raise unless `path` is a folder with a `config.json`; a GGUF file there is pointed at its conversion."""
    if not path.is_dir():
        raise ValueError(f"model directory {path} does not exist; pass a folder written by save_pretrained.")
    if (path / "config.json").exists():
        return
    gguf = sorted(p.name for p in path.glob("*.gguf"))
    if gguf:
        # the probe trains the model as a run would: it needs the weights transformers trains, not a GGUF file
        raise ValueError(
            f"model directory {path} holds {', '.join(gguf)} (GGUF) and no config.json; convert it once: "
            f"model = AutoModelForCausalLM.from_pretrained('{path}', gguf_file='{gguf[0]}', dtype=torch.bfloat16); "
            "model.config.quantization_config = None (if it is set); model.save_pretrained(OUT); then probe OUT."
        )
    raise ValueError(
        f"model directory {path} holds no config.json; pass a folder written by save_pretrained."
    )


def _check_lora_targets(config, targets: list[str]) -> None:
    """Raise if a LoRA target names no module, looking at a weightless (meta-device) copy of the model."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = {name.rsplit(".", 1)[-1] for name, _ in skeleton.named_modules()}
    missing = [t for t in targets if t not in names and t != "all-linear"]
    if missing:
        linear = sorted(
            {n.rsplit(".", 1)[-1] for n, m in skeleton.named_modules() if isinstance(m, torch.nn.Linear)}
        )
        raise ValueError(
            f"--lora-target {','.join(missing)} matches no module of this model; its linear layers are "
            f"{', '.join(linear)}."
        )
