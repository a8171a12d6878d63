"""TRL: SFTTrainer's dataset preparation and the metrics it keeps on the trainer."""

from __future__ import annotations


def sft_prepare_dataset(dataset, tokenizer, args, packing: bool, chat_template, completion_only_loss: bool):
    """The installed TRL's own preparation of a train dataset, for `adaptive-batch plan`."""
    import types

    from trl import SFTTrainer

    # no public function prepares a dataset without a model and a trainer: `_prepare_dataset` runs on a stand-in
    # holding the three attributes it reads (TRL 1.16)
    trainer = types.SimpleNamespace(
        _tokenizer=tokenizer, chat_template=chat_template, completion_only_loss=completion_only_loss
    )
    return SFTTrainer._prepare_dataset(trainer, dataset, tokenizer, args, packing, None, "train")


class TrlMetrics:
    """SFTTrainer's token count and metrics, kept true where `compute_loss` runs more often than TRL expects:
    `restore` drops a failed attempt's, `correct` sets the step's real tokens, `merge` joins eval pieces'."""

    def __init__(self, trainer, mode: str = "train"):
        self.trainer = trainer
        # `_metrics[mode]` and `_total_train_tokens`: TRL appends to and counts them in every `compute_loss` call
        # and exposes them only through its logs
        metrics = getattr(trainer, "_metrics", None)
        self.lists = metrics.get(mode) if isinstance(metrics, dict) else None
        self.lengths = {key: len(values) for key, values in (self.lists or {}).items()}
        self.total_tokens = getattr(trainer, "_total_train_tokens", None)

    def restore(self) -> None:
        if self.lists is not None:
            for key in list(self.lists):
                if key in self.lengths:
                    del self.lists[key][self.lengths[key] :]
                else:
                    del self.lists[key]
        if self.total_tokens is not None:
            self.trainer._total_train_tokens = self.total_tokens

    def merge(self, weights: list[float]) -> None:
        """Where the last `len(weights)` `compute_loss` calls each appended a value, make them their weighted mean."""
        total = sum(weights)
        if self.lists is None or total <= 0:
            return
        for key, values in self.lists.items():
            if len(values) - self.lengths.get(key, 0) == len(weights):
                appended = values[len(values) - len(weights) :]
                del values[len(values) - len(weights) :]
                values.append(sum(v * w for v, w in zip(appended, weights)) / total)

    def correct(self, real_tokens: int) -> None:
        if self.total_tokens is None or not isinstance(self.total_tokens, (int, float)):
            return
        self.trainer._total_train_tokens = self.total_tokens + real_tokens
        if self.lists is not None and "num_tokens" in self.lists:
            self.lists["num_tokens"] = [self.trainer._total_train_tokens]
