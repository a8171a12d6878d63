import pytest

from adaptive_batch.core.fit import predict_peak
from adaptive_batch.core.microbatch import (
    MAX_FAILURES,
    REGROW_AFTER_STEPS,
    MicroBatchTooLargeError,
    StepMemory,
)
from adaptive_batch.core.rows import FIXED, RowController, even_chunk


def run_step(controller, rows, speed, tokens_per_row=100, oom_at=None):
    """Drive one step the way the runner does; `speed(size)` gives tokens/s. Returns the sizes run."""
    sizes, remaining = [], rows
    while remaining > 0:
        size = controller.next_size(remaining)
        if oom_at is not None and size >= oom_at:
            controller.on_out_of_memory(size)
            return sizes + [("oom", size)]
        if controller.needs_timing(size):
            tokens = size * tokens_per_row
            controller.record(size, tokens / speed(size), tokens)
        sizes.append(size)
        remaining -= size
    return sizes


# tokens/s of the QLoRA 7B anchor in DESIGN.md (H200, seq 1024)
H200 = {1: 3035, 2: 6148, 4: 7496, 8: 8124, 16: 8351, 32: 8474, 64: 8586}


def test_even_chunk_balances_the_step():
    assert [even_chunk(r, 4) for r in (10, 6, 3)] == [4, 3, 3]
    assert even_chunk(64, 16) == 16 and even_chunk(65, 16) == 13


def test_grows_inside_the_first_steps_and_settles_when_doubling_stops_paying():
    controller = RowController(start=1, row_limit=64, growth_margin=0.02)
    first = run_step(controller, 64, H200.__getitem__)
    # 1 is timed twice (its first run warms up); 2 and 4 are more than 5 margins (10%) faster at once; 8 (8.4%)
    # and 16 (2.8%) are timed twice
    assert first == [1, 1, 2, 4, 8, 8, 16, 16, 8]
    second = run_step(controller, 64, H200.__getitem__)
    assert second == [32, 32]  # 32 is 1.5% faster than 16: less than the 2% margin
    assert not controller.exploring and controller.size == 16
    assert "less than 2% faster than 16" in controller.settled_because
    assert run_step(controller, 64, H200.__getitem__) == [16, 16, 16, 16]


def test_the_default_margin_goes_on_to_the_largest_size_that_pays():
    controller = RowController(start=1, row_limit=64)
    steps = [run_step(controller, 64, H200.__getitem__) for _ in range(4)]
    assert steps[1:] == [[32, 32], [64], [64]]  # each size is timed twice unless clearly faster
    assert controller.size == 64 and not controller.exploring


# tokens/s of packed rows of 2,048 tokens under sdpa on the H200 (packing_throughput.py, 2026-12-05: plain 2 x 8,
# 4 x 4, 16 x 1 and 1 x 16; 8 between 4 and 16): its packed mask is quadratic in a micro-batch's tokens
PACKED_SDPA = {1: 5077, 2: 5693, 4: 4192, 8: 3300, 16: 2431}


def test_where_the_first_doubling_does_not_pay_it_halves_while_that_pays():
    controller = RowController(start=8, row_limit=16)
    first = run_step(controller, 16, PACKED_SDPA.__getitem__)
    # 8 and 16 timed twice, 16 slower; then 4 (27% faster: decisive), 2 (36%), 1 (11% slower, twice): back at 2
    assert first == [8, 8]
    steps = [run_step(controller, 16, PACKED_SDPA.__getitem__) for _ in range(4)]
    assert steps[:3] == [[16], [16], [4, 2, 1, 1, 2, 2, 2, 2]]  # (16 holds a whole step: one a step)
    assert not controller.exploring and controller.size == 2
    assert controller.settled_because == "1 was less than 1% faster than 2"
    assert steps[3] == [2] * 8
    # where the first doubling paid, a later one that does not settles there: no halving
    rising = RowController(start=8, row_limit=64)
    for _ in range(4):
        run_step(rising, 64, H200.__getitem__)
    assert rising.size == 64 and min(rising.throughput) == 8


def test_a_noisy_first_measurement_is_repeated():
    speeds = iter([1000, 1000, 1015, 1030])  # 4 is 1.5% faster, then 3%: not decisive, so timed twice
    controller = RowController(start=2, row_limit=8, growth_margin=0.02)
    sizes, remaining = [], 16
    while remaining > 0:
        size = controller.next_size(remaining)
        if controller.needs_timing(size):
            controller.record(size, size / next(speeds), size)
        sizes.append(size)
        remaining -= size
    assert sizes[:4] == [2, 2, 4, 4] and controller.size == 4


def test_respects_max_size_and_the_rows_of_a_step():
    controller = RowController(start=4, max_size=8, row_limit=64)
    assert run_step(controller, 64, lambda s: 1000 * s) == [4, 4, 8, 8, 8, 8, 8, 8, 8]  # 4 warms up twice
    assert controller.size == 8 and not controller.exploring
    capped = RowController(start=4, row_limit=12)
    steps = [run_step(capped, 12, lambda s: 1000 * s) for _ in range(3)]
    assert steps == [[4, 4, 4], [8, 4], [12]]
    assert capped.size == 12 and not capped.exploring


def test_a_trial_waits_for_steps_with_enough_rows():
    controller = RowController(start=4, row_limit=32)
    assert run_step(controller, 8, lambda s: 1000 * s) == [4, 4]
    assert controller.trial == 8
    assert run_step(controller, 6, lambda s: 1000 * s) == [3, 3]  # too few rows to time 8: best size known
    assert run_step(controller, 32, lambda s: 1000 * s) == [8, 16, 8]  # 8 doubles the speed: kept at once


def test_out_of_memory_during_a_trial_falls_back_to_the_last_size_that_ran():
    controller = RowController(start=2, row_limit=64)
    steps = run_step(controller, 64, lambda s: 1000 * s, oom_at=8)
    assert steps == [2, 2, 4, ("oom", 8)]
    assert controller.size == 4 and not controller.exploring and controller.oom_sizes == [8]
    assert run_step(controller, 64, lambda s: 1000 * s) == [4] * 16


def test_out_of_memory_at_a_settled_size_halves_it_and_one_sample_raises():
    controller = RowController(start=8, auto=False)
    assert run_step(controller, 16, lambda s: s, oom_at=8) == [("oom", 8)]
    assert controller.size == 4
    assert run_step(controller, 16, lambda s: s, oom_at=4) == [("oom", 4)]
    assert run_step(controller, 16, lambda s: s, oom_at=2) == [("oom", 2)]
    with pytest.raises(MicroBatchTooLargeError) as raised:
        run_step(controller, 16, lambda s: s, oom_at=1)
    assert raised.value.tried == [8, 4, 2, 1]


def test_fixed_size_never_grows():
    controller = RowController(start=3, auto=False)
    assert run_step(controller, 10, lambda s: 1000 * s) == [3, 3, 2, 2]
    assert controller.settled_because == "fixed by micro_batch_size"


def test_memory_prediction_stops_growth_before_an_oom():
    controller = RowController(start=1, row_limit=64, memory_limit=10_000)
    remaining = 64
    while remaining > 0:
        size = controller.next_size(remaining)
        if controller.needs_timing(size):
            tokens = size * 100
            controller.record(
                size, tokens / (1000 * size), tokens, peak_bytes=1000 + 20 * tokens
            )  # 16 -> 33k
        remaining -= size
    assert controller.size == 4 and "predicted to exceed the memory limit" in controller.settled_because


def test_predict_peak_is_an_affine_fit():
    assert predict_peak([(100, 1100), (200, 1200), (400, 1400)], 800) == pytest.approx(1800)
    assert predict_peak([(100, 1100), (100, 1150)], 800) == 0.0


def test_a_cautious_prediction_bounds_the_peak_from_one_measured_size():
    # one distinct token count: no line, so the bound of a peak affine with a non-negative intercept
    assert predict_peak([(100, 1100), (100, 1150)], 800, cautious=True) == pytest.approx(1150 * 8)
    assert predict_peak([(100, 1100)], 50, cautious=True) == 1100  # never below a measured peak
    assert predict_peak([], 800, cautious=True) == float("inf")  # nothing measured, nothing fits
    # two distinct counts: the fitted line, as without caution
    assert predict_peak([(100, 1100), (200, 1200)], 800, cautious=True) == pytest.approx(1800)


def grow_with_memory(controller, peak, rows=64):
    """Run a step, feeding every timed micro-batch a peak of `peak(tokens)` bytes; return the sizes run."""
    sizes, remaining = [], rows
    while remaining > 0:
        size = controller.next_size(remaining)
        if controller.needs_timing(size):
            tokens = size * 100
            controller.record(size, tokens / (1000 * size), tokens, peak_bytes=peak(tokens))
        sizes.append(size)
        remaining -= size
    return sizes


def test_where_an_out_of_memory_error_is_fatal_a_size_grows_only_where_memory_bounds_it_under_the_limit():
    peak = lambda tokens: 1000 + 20 * tokens  # noqa: E731 - the true peak: 4 rows (400 tokens) take 9,000 bytes
    # retried errors: the first doubling is taken on trust (one size measured, no line); here 2 -> 4 fits
    trusting = RowController(start=1, row_limit=64, memory_limit=10_000)
    grow_with_memory(trusting, peak)
    assert trusting.size == 4
    # fatal errors: from 1 row (3,000 bytes) the bound for 2 is 6,000, under the limit: tried; with two sizes the
    # line is known (it is the true peak here) and 8 rows (17,000) are refused, as before
    cautious = RowController(start=1, row_limit=64, memory_limit=10_000, oom_is_fatal=True)
    grow_with_memory(cautious, peak)
    assert cautious.size == 4 and "predicted to exceed the memory limit" in cautious.settled_because
    # a limit of 5,000: 2 rows bounded at 6,000 are never tried where an error is fatal, and are where it is not
    cautious = RowController(start=1, row_limit=64, memory_limit=5_000, oom_is_fatal=True)
    assert grow_with_memory(cautious, peak)[:3] == [1, 1, 1]
    assert cautious.size == 1 and "2 is predicted to exceed the memory limit" in cautious.settled_because
    trusting = RowController(start=1, row_limit=64, memory_limit=5_000)
    assert 2 in grow_with_memory(trusting, peak)


def test_state_dict_round_trip_continues_identically():
    a = RowController(start=1, row_limit=64)
    run_step(a, 20, H200.__getitem__)
    b = RowController(start=1, row_limit=64)
    b.load_state_dict(a.state_dict())
    assert run_step(a, 64, H200.__getitem__) == run_step(b, 64, H200.__getitem__)
    assert a.state_dict() == b.state_dict()


def test_a_fixed_size_held_down_by_a_small_step_comes_back_when_steps_grow():
    """micro_batch_size=32 with steps of 16 rows runs micro-batches of 16; once the effective batch grows to 32
    rows a step, they are the 32 stated (not two of 16), and never more."""
    controller = RowController(32, auto=False, row_limit=16)
    assert controller.size == 16 and controller.larger_step_cap() == 32
    controller.set_row_limit(32)
    assert controller.size == 32
    controller.set_row_limit(64)
    assert controller.size == 32 and controller.larger_step_cap() == 32
    capped = RowController(32, auto=False, max_size=24, row_limit=16)
    capped.set_row_limit(64)
    assert capped.size == 24 and capped.larger_step_cap() == 24
    shrunk = RowController(32, auto=False, row_limit=16)
    shrunk.on_out_of_memory(16)  # 16 failed: 8 from now on, a larger step too
    shrunk.set_row_limit(64)
    assert shrunk.size == 8 and shrunk.larger_step_cap() == 8


def test_a_search_that_stopped_at_a_step_s_rows_goes_on_when_steps_grow():
    controller = RowController(8, auto=True, row_limit=8)
    controller.record(8, 1.0, 800)
    controller.record(8, 1.0, 800)
    assert not controller.exploring and controller.larger_step_cap() is None
    controller.set_row_limit(32)
    assert controller.trial == 16 and controller.larger_step_cap() is None


# -- after an out-of-memory error: one step at half, then the size again (at most MAX_FAILURES times) ----------------


def test_a_size_that_ran_and_then_failed_is_tried_again_after_one_step():
    controller = RowController(8, auto=False, row_limit=8)
    assert controller.end_step(StepMemory(8)) is None  # a step ran at 8
    controller.on_out_of_memory(8)  # a long step, or a fragmented moment
    assert controller.size == 4 and controller.settled_because == "8 ran out of memory"
    notices = [controller.end_step(StepMemory(4)) for _ in range(REGROW_AFTER_STEPS)]
    assert controller.size == 8 and controller.settled_because == FIXED
    assert notices[-1].startswith("Trying micro-batch 8 again: its out-of-memory error")
    assert notices[-1].endswith("if it fails again, it stays below.")  # (MAX_FAILURES = 2)
    controller.on_out_of_memory(8)  # it fails again: the size stays below from then on
    assert [controller.end_step(StepMemory(4)) for _ in range(5)] == [None] * 5 and controller.size == 4
    assert controller.state_dict()["tried_again"] == [8] and MAX_FAILURES == 2


def test_a_step_that_fails_again_lower_tries_the_size_it_first_failed_at():
    # one long step fails at 8 and again at 4, and runs at 2: the next step is at 2, the one after at 8 again
    controller = RowController(8, auto=False, row_limit=8)
    controller.end_step(StepMemory(8))
    controller.on_out_of_memory(8)
    controller.on_out_of_memory(4)
    assert controller.size == 2
    notices = [controller.end_step(StepMemory(2)) for _ in range(REGROW_AFTER_STEPS)]
    assert controller.size == 8 and notices[-1].startswith("Trying micro-batch 8 again")


def test_a_size_that_never_ran_a_step_is_not_tried_again():
    # a stated size too large from the start: its first step fails, and it does not cost a second one
    controller = RowController(8, auto=False, row_limit=8)
    controller.on_out_of_memory(8)
    assert [controller.end_step(StepMemory(4)) for _ in range(5)] == [None] * 5 and controller.size == 4
    assert controller.state_dict()["largest_run"] == 4


def test_a_size_is_tried_again_only_where_the_peaks_measured_since_say_it_fits():
    controller = RowController(8, auto=False, row_limit=8, memory_limit=1_000)
    controller.end_step(StepMemory(8))  # a step ran at 8 (its peak not measured)
    controller.on_out_of_memory(8)
    # at 4 rows of 100 tokens the step peaked at 600 bytes: 8 rows would need up to 1,200, over the limit
    assert controller.end_step(StepMemory(4, tokens=400, peak_bytes=600)) is None and controller.size == 4
    fitting = RowController(8, auto=False, row_limit=8, memory_limit=1_000)
    fitting.end_step(StepMemory(8))
    fitting.on_out_of_memory(8)
    assert fitting.end_step(StepMemory(4, tokens=400, peak_bytes=450)) and fitting.size == 8  # up to 900


def test_allocator_thrash_steps_down_without_running_the_step_again():
    controller = RowController(16, auto=False, row_limit=16)
    notice = controller.end_step(StepMemory(16, tokens=1600, peak_bytes=None, thrashed=True))
    assert controller.size == 8 and notice == "Allocator thrash at micro-batch 16: the next steps run at 8."
    assert controller.settled_because == "16 made the allocator free its cache to retry (allocator thrash)"
    state = controller.state_dict()  # what a resumed run needs to try 16 again on time
    restored = RowController(16, auto=False, row_limit=16)
    restored.load_state_dict(state)
    assert (restored.shrunk_from, restored.steps_since_shrink) == (16, 0)


def test_the_settled_message_names_the_limit_it_reached():
    capped = RowController(4, auto=True, max_size=8, row_limit=64)
    for size in (4, 4, 8, 8):
        capped.record(size, 1.0 / size, 100)  # each doubling twice as fast
    assert capped.settled_because == "it reached max_micro_batch_size=8"
    step = RowController(4, auto=True, row_limit=8)
    for size in (4, 4, 8, 8):
        step.record(size, 1.0 / size, 100)
    assert step.settled_because == "it reached the 8 rows a step holds on a rank"


class Sequences:
    """A padding-free step batch as the controllers see it: sequences of these lengths."""

    packed = True

    def __init__(self, lengths):
        self.lengths_list, self.rows = lengths, len(lengths)


def test_packed_rows_are_cut_into_runs_of_whole_sequences_of_their_tokens():
    # 2 packed rows of 100 tokens a micro-batch: sequences of 60, 50, 40 (150), then 90, 30, 20 (140)
    controller = RowController(2, auto=False, row_limit=8, row_tokens=100)
    cut = controller.cut(Sequences([60, 50, 40, 90, 30, 20]), max_rows=6, agree=lambda values: values)
    assert [(m.start, m.rows, m.size, m.timed, m.last) for m in cut] == [
        (0, 3, 2, False, False),
        (3, 3, 2, False, True),
    ]
    # a rank with fewer runs as many micro-batches as the one with most: a row that adds nothing
    cut = controller.cut(Sequences([60, 50, 40, 90, 30, 20]), max_rows=6, agree=lambda values: [3])
    assert [(m.start, m.rows, m.last) for m in cut] == [(0, 3, False), (3, 3, False), (0, 0, True)]
    assert "packed rows" in controller.describe() and controller.unit == "packed rows"


def test_a_packed_trial_times_the_steps_first_micro_batches_at_its_size():
    controller = RowController(1, auto=True, row_limit=8, row_tokens=100)  # trial 1, timed twice
    cut = list(controller.cut(Sequences([90, 80, 70, 60]), max_rows=4, agree=lambda values: values))
    assert [(m.rows, m.size, m.timed) for m in cut] == [
        (1, 1, True),
        (1, 1, True),
        (1, 1, False),
        (1, 1, False),
    ]
