"""Bad input gets one clear error naming the value, the rule and a fix, before any compute."""

from types import SimpleNamespace

import pytest
import torch
from transformers import Trainer

from adaptive_batch import AdaptiveBatch, NoiseScaleSchedule, PhaseSchedule


def no_compute(trainer):
    """The model was never called."""
    calls = []
    trainer.model.register_forward_pre_hook(lambda *a: calls.append(1))
    return calls


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"micro_batch_size": 0}, r"micro_batch_size=0 must be 'auto' or a positive int"),
        ({"micro_batch_size": "max"}, r"micro_batch_size='max'"),
        (
            {"micro_batch_size": 16, "max_micro_batch_size": 8},
            r"micro_batch_size=16 exceeds max_micro_batch_size=8",
        ),
        ({"max_micro_batch_size": 0}, r"max_micro_batch_size=0"),
        ({"lr_scaling": "cubic"}, r"lr_scaling='cubic' is not one of"),
        ({"growth_margin": 1.5}, r"growth_margin=1.5 must be in \[0, 1\)"),
        ({"schedule": 0}, r"effective batch 0"),
        ({"schedule": "32"}, r"neither an int nor a callable"),
    ],
)
def test_bad_settings_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdaptiveBatch(**kwargs)


def test_auto_find_batch_size_is_refused(make_trainer):
    with pytest.raises(ValueError, match="auto_find_batch_size=True .* Set auto_find_batch_size=False"):
        make_trainer([AdaptiveBatch()], auto_find_batch_size=True)


def test_a_schedule_that_goes_bad_later_fails_when_the_trainer_is_built(make_trainer):
    with pytest.raises(
        ValueError, match=r"schedule at step 3 .* gave effective batch 0; it must be a positive integer"
    ):
        make_trainer([AdaptiveBatch(schedule=lambda progress: 8 if progress.step < 3 else 0)])
    with pytest.raises(ValueError, match=r"gave effective batch 6.5; .* \(e.g. 6\)"):
        make_trainer([AdaptiveBatch(schedule=lambda progress: 6.5)])
    with pytest.raises(ValueError, match=r"effective batch 64 at step 0 .* exceeds the dataset size 40"):
        make_trainer([AdaptiveBatch(schedule=64)])


def test_a_changed_argument_is_checked_again_when_training_starts(make_trainer):
    trainer = make_trainer([AdaptiveBatch()])
    calls = no_compute(trainer)
    trainer.args.num_train_epochs = 0
    with pytest.raises(ValueError, match="num_train_epochs=0 must be positive"):
        trainer.train()
    assert calls == []


def test_a_trainer_that_builds_its_own_dataloader_is_refused(make_trainer):
    class Custom(Trainer):
        def get_train_dataloader(self):
            return super().get_train_dataloader()

    with pytest.raises(ValueError, match="Custom overrides get_train_dataloader"):
        make_trainer([AdaptiveBatch()], trainer_class=Custom)


def test_length_grouped_sampling_is_refused(make_trainer):
    with pytest.raises(ValueError, match="train_sampling_strategy='group_by_length'"):
        make_trainer([AdaptiveBatch()], train_sampling_strategy="group_by_length")


def test_fsdp1_is_refused_with_the_fix(make_trainer):
    trainer = make_trainer()
    trainer.is_fsdp_enabled = True  # what Trainer.__init__ sets under FSDP; no plugin stated: version 1
    with pytest.raises(ValueError, match=r"FSDP version 1 is not supported.*fsdp_config=\{'version': 2\}"):
        AdaptiveBatch.attach(trainer)


def test_a_noise_scale_schedule_is_refused_under_fsdp2(make_trainer, monkeypatch):
    trainer = make_trainer()
    trainer.is_fsdp_enabled = True  # what Trainer.__init__ sets under FSDP2
    monkeypatch.setattr(
        trainer.accelerator.state, "fsdp_plugin", SimpleNamespace(fsdp_version=2), raising=False
    )
    with pytest.raises(ValueError, match="noise scale, which is not measured under FSDP2"):
        AdaptiveBatch.attach(trainer, schedule=NoiseScaleSchedule(8, max_size=32))


def test_attaching_twice_or_too_late_is_refused(make_trainer):
    trainer = make_trainer([AdaptiveBatch()])
    with pytest.raises(ValueError, match="already has an AdaptiveBatch attached"):
        AdaptiveBatch.attach(trainer)
    late = make_trainer()
    late.add_callback(AdaptiveBatch())
    calls = no_compute(late)
    with pytest.raises(RuntimeError, match="added after the Trainer was built .* AdaptiveBatch.attach"):
        late.train()
    assert calls == []


def test_a_scheduler_that_cannot_follow_a_changing_batch_is_refused(make_trainer):
    trainer = make_trainer(
        [AdaptiveBatch(schedule=PhaseSchedule([4, 8], boundaries=[0.5]))],
        lr_scheduler_type="reduce_lr_on_plateau",
        eval_strategy="epoch",
        eval_dataset=[],
    )
    calls = no_compute(trainer)
    with pytest.raises(ValueError, match="ReduceLROnPlateau cannot follow a changing effective batch"):
        trainer.train()
    assert calls == []


def test_a_constant_batch_keeps_any_scheduler(make_trainer, rows):
    trainer = make_trainer(
        [AdaptiveBatch()],
        lr_scheduler_type="reduce_lr_on_plateau",
        num_rows=16,
        eval_strategy="epoch",
        eval_dataset=rows[100:104],
    )
    trainer.train()
    assert isinstance(trainer.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def test_a_packed_dataset_is_counted_in_packed_rows(tokenizer, texts, tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from adaptive_batch.testing import tiny_llama

    args = SFTConfig(
        output_dir=str(tmp_path),
        packing=True,
        packing_strategy="wrapped",
        max_length=256,
        per_device_train_batch_size=8,
        report_to=[],
        use_cpu=True,
    )
    dataset = Dataset.from_dict({"text": texts[:64]})
    with pytest.raises(
        ValueError, match=r"exceeds the dataset size \d+ packed rows \(TRL's packing=True puts"
    ):
        SFTTrainer(
            model=tiny_llama(tokenizer),
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[AdaptiveBatch(schedule=64)],
        )
