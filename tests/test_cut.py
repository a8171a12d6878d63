"""The token cut (`cut.py`) against brute force, and the token budget's measurements (`tokenbudget.py`): the
overhead of a micro-batch fitted from timings, the budget grown while the cut needs more and memory allows."""

import json
import random

from adaptive_batch.core.cut import cheapest_chunks, fewest_chunks, rows_first_fit
from adaptive_batch.core.tokens import CALIBRATION_STEPS, TokenController, fitted_overhead


def set_partitions(items: list[int]):
    """Every way to split `items` into blocks (Bell-number many)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        yield [[first], *partition]
        for i in range(len(partition)):
            yield [*partition[:i], [first, *partition[i]], *partition[i + 1 :]]


def chunk_tokens(lengths: list[int], sizes: list[int]) -> list[int]:
    """Padded tokens of each micro-batch when `lengths` (longest first) are cut into runs of `sizes`."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [size * max(lengths[start : start + size]) for start, size in zip(starts, sizes)]


def brute_force(lengths, budget, row_cap, overhead):
    """(cost, micro-batches, peak) of the best of all groupings of the padded rows, in any order."""
    best = None
    for partition in set_partitions(list(range(len(lengths)))):
        tokens = [len(block) * max(lengths[i] for i in block) for block in partition]
        if any(len(b) > 1 and t > budget for b, t in zip(partition, tokens)):
            continue
        if row_cap is not None and any(len(b) > row_cap for b in partition):
            continue
        key = (overhead * len(partition) + sum(tokens), len(partition), max(tokens))
        best = key if best is None or key < best else best
    return best


def test_the_cheapest_cut_is_the_best_of_all_groupings():
    generator = random.Random(0)
    for _ in range(150):
        lengths = sorted((generator.randint(1, 40) for _ in range(generator.randint(1, 7))), reverse=True)
        budget = generator.randint(1, 160)
        row_cap = generator.choice([None, 1, 2, 3])
        overhead = generator.choice([0, 1, 5, 20, 100])
        sizes = cheapest_chunks(lengths, budget, row_cap, overhead)
        assert sum(sizes) == len(lengths)
        tokens = chunk_tokens(lengths, sizes)
        assert all(size == 1 or t <= budget for size, t in zip(sizes, tokens))
        assert row_cap is None or max(sizes) <= row_cap
        found = (overhead * len(sizes) + sum(tokens), len(sizes), max(tokens))
        assert found == brute_force(lengths, budget, row_cap, overhead), (lengths, budget, overhead)


def test_the_overhead_decides_between_padding_and_micro_batches():
    lengths = [100, 100, 10, 10]
    assert cheapest_chunks(lengths, 400, None, overhead=50) == [2, 2]  # 220 tokens + 2 x 50 < 400 + 50
    assert cheapest_chunks(lengths, 400, None, overhead=200) == [4]  # 400 + 200 < 220 + 2 x 200
    assert cheapest_chunks(lengths, 400, None, overhead=0) == [2, 2]  # rows of one length stay together
    assert fewest_chunks(lengths, 400, None) == [4]


def test_a_large_overhead_gives_the_fewest_micro_batches():
    generator = random.Random(1)
    for _ in range(100):
        lengths = sorted((generator.randint(1, 50) for _ in range(generator.randint(1, 20))), reverse=True)
        budget, row_cap = generator.randint(1, 300), generator.choice([None, 2, 4])
        cheapest = cheapest_chunks(lengths, budget, row_cap, overhead=10**6)
        assert len(cheapest) == len(fewest_chunks(lengths, budget, row_cap))


# -- the overhead, measured ------------------------------------------------------------------------------------------


def test_sequences_packed_into_rows_first_fit_fill_each_row_within_its_width():
    generator = random.Random(0)
    for _ in range(200):
        width = generator.choice([64, 128, 192])
        lengths = sorted((generator.randint(1, width) for _ in range(generator.randint(1, 30))), reverse=True)
        rows = rows_first_fit(lengths, width)
        assert sorted(i for row in rows for i in row) == list(range(len(lengths)))  # each sequence once
        assert all(sum(lengths[i] for i in row) <= width for row in rows)
        # first fit: no sequence would have fitted in an earlier row when it was placed
        for r, row in enumerate(rows):
            for i in row:
                for earlier in rows[:r]:
                    assert sum(lengths[j] for j in earlier if j < i) + lengths[i] > width
        assert len(rows) <= 2 * -(
            -sum(lengths) // width
        )  # first fit decreasing: at most about twice the least


def test_the_fewest_chunks_of_sequences_in_rows_keep_each_chunks_rows_within_the_budget():
    generator = random.Random(1)
    for _ in range(200):
        width = 64 * generator.randint(1, 4)
        lengths = sorted((generator.randint(1, width) for _ in range(generator.randint(1, 40))), reverse=True)
        budget = width * generator.randint(1, 8)
        sizes = fewest_chunks(lengths, budget, None, packed=True, width=width)
        assert sum(sizes) == len(lengths) and all(size >= 1 for size in sizes)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        chunks = [lengths[start : start + size] for start, size in zip(starts, sizes)]
        assert all(len(rows_first_fit(chunk, width)) * width <= budget for chunk in chunks)
        # as few as any cut into runs of consecutive sequences allows (dynamic programming over every cut)
        least = [0] + [len(lengths) + 1] * len(lengths)
        for end in range(1, len(lengths) + 1):
            for start in range(end):
                if len(rows_first_fit(lengths[start:end], width)) * width <= budget:
                    least[end] = min(least[end], least[start] + 1)
        assert len(sizes) == least[-1]


def test_the_fitted_overhead_is_the_intercept_over_the_slope():
    assert fitted_overhead([(1000, 0.2), (3000, 0.4), (2000, 0.3)]) == 1000
    assert fitted_overhead([(500, 0.05), (1500, 0.15)]) == 0  # no fixed part
    assert fitted_overhead([(1000, 0.3), (3000, 0.2)]) is None  # time falling with tokens: no line to trust
    assert fitted_overhead([(1000, 0.3), (1000, 0.2)]) is None  # one size: no slope


def test_a_few_slow_micro_batches_do_not_tip_the_fitted_overhead():
    # 0.1 s + 0.0001 s per token (an overhead of 1,000), and three micro-batches slowed by a compile or a busy host,
    # the smallest among them, as on the H200 (`benchmarks/results/ragged_throughput_h200_rounds_lsq.json`), where a
    # least-squares line fell and the cut became one micro-batch padded to the step's longest row
    points = [(tokens, 0.1 + 0.0001 * tokens) for tokens in range(1000, 9000, 700)]
    points += [(900, 2.4), (2200, 14.2), (3100, 11.8)]
    assert fitted_overhead(points) == 1000


def test_where_the_times_give_no_rising_line_the_cut_keeps_one_longest_row_of_overhead():
    controller = TokenController(100, 8)
    controller.end_step(bound=False)  # the warm-up step
    for _ in range(CALIBRATION_STEPS):
        controller.record(0.5, 40)
        controller.record(0.4, 80)
        controller.end_step(bound=False)
    assert not controller.exploring and controller.overhead is None
    assert controller.token_overhead(longest=32) == 32  # not None: the fewest micro-batches
    assert "overhead one longest row" in controller.settled_because
    restored = TokenController(100, 8)
    restored.load_state_dict(json.loads(json.dumps(controller.state_dict())))
    assert restored.token_overhead(longest=32) == 32


def tuned(max_tokens=100, memory_limit=None, overhead=None):
    return TokenController(max_tokens, 8, tune=True, overhead=overhead, memory_limit=memory_limit)


def test_the_overhead_is_measured_after_a_warm_up_step_and_then_fixed():
    controller = TokenController(100, 8)
    assert controller.exploring and controller.token_overhead(longest=32) == 32  # meanwhile: one longest row
    seconds = lambda tokens: 0.01 + 0.0001 * tokens  # noqa: E731 - an overhead of 100 tokens
    controller.record(5.0, 50)  # the warm-up step: slow, not counted
    controller.end_step(bound=False)
    for _ in range(CALIBRATION_STEPS):
        assert controller.exploring
        for tokens in (40, 80):
            controller.record(seconds(tokens), tokens)
        controller.end_step(bound=False)
    assert not controller.exploring
    assert controller.overhead == 100 and controller.token_overhead(longest=32) == 100
    assert controller.settled_because == "token budget 100 (stated), overhead 100 tokens"


def test_a_stated_overhead_is_not_measured():
    controller = TokenController(100, 8, overhead=7)
    assert not controller.exploring and controller.token_overhead(longest=32) == 7


def test_the_budget_doubles_while_the_cut_needs_more_and_memory_allows():
    # peak memory: 1 GB + 1 MB per token; a limit of 1.5 GB admits up to 500,000 tokens
    controller = tuned(max_tokens=100_000, memory_limit=1.5e9, overhead=0)
    for tokens in (50_000, 100_000):
        controller.record(1.0, tokens, peak_bytes=1e9 + 1e3 * tokens)
    controller.end_step(bound=True)
    assert controller.max_tokens == 200_000 and controller.exploring
    controller.end_step(bound=True)
    assert controller.max_tokens == 400_000
    controller.end_step(bound=True)  # 800,000 is predicted at 1.8 GB
    assert controller.max_tokens == 400_000 and not controller.exploring
    assert "800,000 is predicted to exceed the memory limit" in controller.settled_because


def test_where_an_out_of_memory_error_is_fatal_the_budget_doubles_only_under_the_bound_of_one_size():
    # every micro-batch of 100,000 tokens peaked at 1.2 GB: no line, so doubling is bounded by 2.4 GB
    for limit, grows in ((2.5e9, True), (2.0e9, False)):
        controller = TokenController(100_000, 8, tune=True, overhead=0, memory_limit=limit, oom_is_fatal=True)
        controller.record(1.0, 100_000, peak_bytes=1.2e9)
        controller.end_step(bound=True)
        assert controller.max_tokens == (200_000 if grows else 100_000), limit
    trusting = tuned(max_tokens=100_000, memory_limit=2.0e9, overhead=0)  # a retried error: taken on trust
    trusting.record(1.0, 100_000, peak_bytes=1.2e9)
    trusting.end_step(bound=True)
    assert trusting.max_tokens == 200_000


def test_the_budget_stops_growing_when_a_larger_one_would_not_change_the_cut():
    controller = tuned(overhead=0)
    controller.end_step(bound=True)
    controller.end_step(bound=False)
    assert controller.max_tokens == 200 and not controller.exploring
    assert (
        controller.settled_because
        == "token budget 200 (a larger one would not change the cut), overhead 0 tokens (a micro-batch's time rose "
        "with its padded tokens alone, as on a CPU: rows of different lengths then run in micro-batches of their "
        "own, down to one row, to save padding)"
    )


def test_out_of_memory_halves_the_budget_and_ends_its_growth():
    controller = tuned(overhead=0)
    controller.end_step(bound=True)
    controller.on_out_of_memory(4, padded_tokens=180)
    assert controller.max_tokens == 90 and not controller.tuning
    assert "180 padded tokens ran out of memory" in controller.budget_because


def test_what_the_token_budget_learned_survives_a_checkpoint():
    controller = tuned()
    controller.record(5.0, 50)
    controller.end_step(bound=True)
    controller.record(0.2, 60)
    restored = tuned()
    restored.load_state_dict(json.loads(json.dumps(controller.state_dict())))
    assert restored.state_dict() == controller.state_dict()
    assert restored.max_tokens == 200 and restored.time_points == [(60.0, 0.2)] and restored.calibrating


def calibrated(seconds, tokens=(40, 80)):
    """A tuned controller (budget 100) whose warm-up and calibration steps timed `tokens` by `seconds`."""
    controller = tuned()
    controller.end_step(bound=True)  # the warm-up step: the budget doubles, still measuring
    for _ in range(CALIBRATION_STEPS):
        for size in tokens:
            controller.record(seconds(size), size)
        controller.end_step(bound=True)
    assert not controller.calibrating and controller.tuning
    return controller


def test_a_budget_whose_larger_micro_batches_run_as_the_line_predicts_keeps_growing_and_refits():
    line = lambda tokens: 0.01 + 0.0001 * tokens  # noqa: E731 - an overhead of 100 tokens
    controller = calibrated(line)
    budget = controller.max_tokens
    larger = [(tokens, line(tokens) * 1.1) for tokens in range(1000, 1800, 100)]  # 10%: within LINE_MARGIN
    for tokens, seconds in larger:
        controller.record(seconds, tokens)
    controller.end_step(bound=True)
    assert controller.tuning and controller.max_tokens == 2 * budget
    assert controller.overhead == fitted_overhead(controller.time_points) != 100  # fitted again, on them too


def test_a_budget_whose_larger_micro_batches_run_slower_than_the_line_falls_back_and_stops():
    # flex attention on the H200: about the same time from 2,000 to 5,000 padded tokens, then 120 us per token,
    # so the line of the small ones (a large overhead) would pad the whole step into one micro-batch
    flat_then_steep = lambda tokens: max(0.55, 0.00012 * tokens)  # noqa: E731
    controller = calibrated(
        lambda tokens: flat_then_steep(tokens * 50) + 0.0001 * tokens, tokens=(40, 60, 80)
    )
    overhead = controller.overhead
    budget = controller.max_tokens
    controller.record(flat_then_steep(300 * 50), 300)
    controller.end_step(bound=True)
    assert controller.tuning and controller.max_tokens == budget  # once: held, tried again
    assert (300.0, flat_then_steep(300 * 50)) not in controller.time_points
    controller.record(flat_then_steep(250 * 50), 250)
    controller.end_step(bound=True)
    assert not controller.exploring
    assert controller.max_tokens == 80  # the largest micro-batch the line was fitted on
    assert controller.overhead == overhead  # not fitted again on the points that broke it
    assert "micro-batches above 80 padded tokens ran" in controller.settled_because
    assert "slower than the line measured up to there predicts, twice" in controller.settled_because


def test_one_slow_step_of_a_grown_budget_is_tried_again_and_then_forgotten():
    line = lambda tokens: 0.01 + 0.0001 * tokens  # noqa: E731
    controller = calibrated(line)
    budget = controller.max_tokens
    controller.record(line(1500) * 5, 1500)  # a slow moment of the host
    controller.end_step(bound=True)
    assert controller.tuning and controller.max_tokens == budget and controller.line_missed > 3
    controller.record(line(1500), 1500)  # as predicted: it grows again
    controller.end_step(bound=True)
    assert controller.tuning and controller.max_tokens == 2 * budget and controller.line_missed is None


def test_the_budget_waits_for_the_measured_overhead_before_it_stops_growing():
    controller = tuned()  # the overhead is measured: a larger one may want larger micro-batches
    controller.end_step(bound=False)
    assert controller.tuning and controller.max_tokens == 100
    for _ in range(CALIBRATION_STEPS):
        controller.record(0.3, 40)
        controller.record(0.5, 80)
        controller.end_step(bound=False)
    assert not controller.calibrating and controller.tuning  # the next step is cut with the measured overhead
    controller.end_step(bound=True)
    assert controller.max_tokens == 200 and controller.tuning
    controller.end_step(bound=False)
    assert not controller.exploring and controller.max_tokens == 200


def test_a_halved_budget_is_tried_again_after_one_step_and_twice_at_most():
    from adaptive_batch.core.microbatch import StepMemory

    controller = TokenController(128, overhead=0)
    controller.end_step(bound=False, memory=StepMemory(4, tokens=64))  # a micro-batch of 64 tokens had run
    controller.on_out_of_memory(rows=3, padded_tokens=60)
    assert controller.max_tokens == 30
    notice = controller.end_step(bound=False, memory=StepMemory(2, tokens=30))
    assert controller.max_tokens == 128 and notice.startswith("Trying the token budget of 128 again")
    # it fails again, at 92 tokens: never above half the smallest that failed, and not tried again
    controller.on_out_of_memory(rows=3, padded_tokens=92)
    assert controller.max_tokens == 30
    assert (
        controller.end_step(bound=False, memory=StepMemory(2, tokens=30)) is None
        and controller.max_tokens == 30
    )
    # where no micro-batch as large as the one that failed had run, the failure marks the memory's limit: the
    # budget is not tried again
    fresh = TokenController(128, overhead=0)
    fresh.end_step(bound=False, memory=StepMemory(2, tokens=50))
    fresh.on_out_of_memory(rows=3, padded_tokens=60)
    assert fresh.end_step(bound=False, memory=StepMemory(2, tokens=30)) is None and fresh.max_tokens == 30


def test_allocator_thrash_halves_the_budget_under_the_largest_micro_batch():
    from adaptive_batch.core.microbatch import StepMemory

    controller = TokenController(1000, overhead=0)
    notice = controller.end_step(bound=False, memory=StepMemory(4, tokens=800, thrashed=True))
    assert controller.max_tokens == 400 and notice.startswith("Allocator thrash at 800 padded tokens")
    restored = TokenController(1000, overhead=0)
    restored.load_state_dict(controller.state_dict())
    assert (restored.max_tokens, restored.shrunk_from) == (400, 1000)
