"""adaptive-batch: exact, OOM-proof, adaptive batch sizes for the Hugging Face Trainer and TRL's SFTTrainer:
`Trainer(..., callbacks=[AdaptiveBatch()])`."""

import logging

from .core.goodput import NoiseScaleSchedule
from .core.microbatch import MicroBatchTooLargeError
from .core.schedule import ConstantSchedule, PhaseSchedule, Progress

__version__ = "0.1.0"

# as a library configures its logger: records propagate to whatever the application configured
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "AdaptiveBatch",
    "ConstantSchedule",
    "MicroBatchTooLargeError",
    "NoiseScaleSchedule",
    "PhaseSchedule",
    "Progress",
    "__version__",
]


def __getattr__(name):
    # The callback imports transformers; the pure core (schedules, plans, LR rules) does not need it.
    if name == "AdaptiveBatch":
        from .hf.callback import AdaptiveBatch

        return AdaptiveBatch
    raise AttributeError(f"module 'adaptive_batch' has no attribute {name!r}")
