"""transformers: the Trainer's (and a model config's) internals that AdaptiveBatch reads, sets or overrides."""

from __future__ import annotations

import inspect

# The Trainer methods AdaptiveBatch replaces with its step sampler; a user's class that overrides one is refused.
REPLACED_DATA_METHODS = ("get_train_dataloader", "_get_train_sampler")

# Keys of a model config that do not change memory (the probe's cache compares the rest): `_name_or_path` is the
# folder or hub name `from_pretrained` records.
CONFIG_BOOKKEEPING_KEYS = (
    "_name_or_path",
    "transformers_version",
    "architectures",
    "torch_dtype",
    "dtype",
    "use_cache",
)


def trainer_being_built(callback):
    """The Trainer whose `__init__` calls `callback.on_init_end` (callbacks get none: read from its frame)."""
    from transformers import Trainer

    init = inspect.unwrap(Trainer.__init__).__code__
    frame = inspect.currentframe()
    try:
        for _ in range(16):  # the handler's two calls, a subclass's on_init_end, decorators
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            if frame.f_code is init:
                trainer = frame.f_locals.get("self")
                handler = getattr(trainer, "callback_handler", None)
                return trainer if callback in getattr(handler, "callbacks", ()) else None
        return None
    finally:
        del frame


def user_class(trainer, method: str) -> type:
    """The class whose `method` the Trainer runs, AdaptiveBatch's mixin looked past: the user's, or the library's."""
    return next(
        c for c in type(trainer).__mro__ if method in vars(c) and not vars(c).get("_adaptive_batch_mixin")
    )


def put_in_front(trainer, mixin: type, prefix: str) -> None:
    """Give this Trainer instance a class of its own with `mixin` in front: its methods win for this instance only."""
    cls = type(trainer)
    trainer.__class__ = type(f"{prefix}{cls.__name__}", (mixin, cls), {})


class KeepsLiveCallbackState:
    """Keeps AdaptiveBatch's callback live on resume: left out while the Trainer re-creates the others."""

    callback_state_key: str

    # `_load_callback_state` re-creates every stateful callback from the checkpoint; no public hook skips one
    def _load_callback_state(self):
        key = self.callback_state_key
        stored = self.state.stateful_callbacks.pop(key, None)
        try:
            return super()._load_callback_state()
        finally:
            # the next save updates this entry in place, so it must exist, also in a plain Trainer's checkpoint
            self.state.stateful_callbacks[key] = stored if stored is not None else {}


def saved_callback_state(trainer_state: dict, name: str) -> dict | None:
    """The `attributes` a callback's `state()` saved in `trainer_state.json` (the first of several of one class)."""
    entry = (trainer_state.get("stateful_callbacks") or {}).get(name)
    if isinstance(entry, list):
        entry = entry[0] if entry else None
    return entry.get("attributes") if isinstance(entry, dict) else None


def base_model(model):
    """The model inside DDP's wrapper (`module`) and PEFT's (`get_base_model()`), whose class and config are the
    user's model's."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def attention_implementation(model) -> str | None:
    config = getattr(getattr(model, "module", model), "config", None)  # (DDP wraps the model)
    # `_attn_implementation` is where transformers keeps the one in use (`attn_implementation` is only an argument)
    return getattr(config, "_attn_implementation", None)


def forget_eval_dataloaders(trainer) -> None:
    """Drop the eval loaders the Trainer kept for persistent workers: a changed eval batch needs them rebuilt."""
    kept = getattr(trainer, "_eval_dataloaders", None)  # the Trainer's cache of them, with no public reset
    if isinstance(kept, dict):
        kept.clear()


def loss_shifts_labels(trainer) -> bool:
    """Whether the Trainer counts label tokens after shifting, as it does for `num_items_in_batch`."""
    return bool(getattr(trainer, "_loss_shifts_labels", False))  # set in `__init__`, read nowhere public


def loss_normalised_over_ranks(trainer) -> bool:
    """Whether `Trainer.compute_loss` normalises the loss by `num_items_in_batch` counted over all ranks."""
    custom_loss = getattr(trainer, "compute_loss_func", None) is not None
    takes_items = bool(getattr(trainer, "model_accepts_loss_kwargs", False)) or custom_loss
    return bool(getattr(trainer.args, "average_tokens_across_devices", False)) and takes_items


def train_dataset_and_collator(trainer, dataset, collator):
    """The dataset and collator as `Trainer.get_train_dataloader` would use them: unused columns removed."""
    from ..lengths import is_hf_dataset

    # the Trainer's own private helpers: no public function removes the columns the model does not take
    if is_hf_dataset(dataset):
        return trainer._remove_unused_columns(dataset, description="training"), collator
    return dataset, trainer._get_collator_with_removed_columns(collator, description="training")


def pad_to_multiple_of(trainer) -> int:
    """The multiple the data collator pads a batch's width to (transformers' and TRL's collators say it), else 1."""
    multiple = getattr(trainer.data_collator, "pad_to_multiple_of", None)
    return multiple if isinstance(multiple, int) and multiple > 0 else 1


def padding_free(trainer) -> bool:
    """Whether the collator flattens each batch into one row of sequences (also TRL's `padding_free`)."""
    from transformers import DataCollatorWithFlattening

    collator = trainer.data_collator
    if isinstance(collator, DataCollatorWithFlattening):
        return True
    return bool(getattr(collator, "padding_free", False) or getattr(trainer, "padding_free", False))


# The classes whose own `training_step` and `compute_loss` read `attention_mask` for the model's attention
# alone (True: SFTTrainer, which also counts tokens from it, is given `position_ids` in its place)
MASK_BLIND_STEPS = {
    ("transformers.trainer", "Trainer"): False,
    ("trl.trainer.sft_trainer", "SFTTrainer"): True,
}


def causal_rows(trainer) -> tuple[bool, bool]:
    """`(causal, positions)`: whether the step's rows may be packed or leave their padding mask out as far as the
    Trainer's side can tell (its inputs read only by a library's own `training_step` and `compute_loss`, a model that
    is not an encoder-decoder, no router loss averaged over the mask), and whether `position_ids` replace the mask
    (SFTTrainer counts tokens from them). Whether the model computes such rows exactly is shown by a forward
    ([`model_checks.check_layout`]), not read from its name. See docs/how-it-works.md, "Which models are packed"."""
    owners = [user_class(trainer, method) for method in ("training_step", "compute_loss")]
    readers = {MASK_BLIND_STEPS.get((owner.__module__, owner.__name__)) for owner in owners}
    positions = max(readers) if None not in readers else None
    config = getattr(base_model(trainer.model), "config", None)
    if positions is None or config is None:
        return False, False
    # an encoder-decoder's rows are its encoder's; a router's auxiliary loss averages over the batch's tokens
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "output_router_logits", False):
        return False, False
    return True, positions
