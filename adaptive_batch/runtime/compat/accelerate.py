"""accelerate: the Accelerator's collectives, guarded for the rank-agreement protocol ([`ranks`])."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

# The collectives the Trainer and TRL (its metrics) call through the Accelerator inside a micro-batch: a rank
# that ran out of memory before reaching one would leave the others waiting in it for ever.
GUARDED_COLLECTIVES = ("gather", "gather_for_metrics", "reduce", "pad_across_processes")

_ABSENT = object()


@contextlib.contextmanager
def before_collectives(accelerator, check: Callable[[], None]) -> Iterator[None]:
    """Call `check()` before each of the Accelerator's outermost collectives within the block: accelerate has no
    hook before a collective, so the instance's methods are wrapped, and given back after."""
    depth = 0
    saved: dict[str, object] = {}

    def guard(method):
        def guarded(*args, **kwargs):
            nonlocal depth
            if depth == 0:
                check()
            depth += 1
            try:
                return method(*args, **kwargs)
            finally:
                depth -= 1

        return guarded

    for name in GUARDED_COLLECTIVES:
        method = getattr(accelerator, name, None)
        if method is None:
            continue
        saved[name] = accelerator.__dict__.get(name, _ABSENT)
        setattr(accelerator, name, guard(method))
    try:
        yield
    finally:
        for name, previous in saved.items():
            if previous is _ABSENT:
                delattr(accelerator, name)
            else:
                setattr(accelerator, name, previous)
