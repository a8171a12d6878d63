"""The eval batch's sizer under `adapt_evaluation="grow"` (pure: no torch): it doubles from one evaluation to the
next while rows/s rise by the margin and the doubled batch's predicted memory fits, then keeps the fastest size."""

from adaptive_batch.core.eval_size import EvalMeasure, EvalSizer

GIB = 2.0**30


def evaluate(sizer: EvalSizer, seconds: float, rows: int = 1000, **memory) -> tuple[int, str | None]:
    """One evaluation at the sizer's size: what it logged, and the size it chose for the next."""
    size = sizer.batch_size(rows)
    line = sizer.record(EvalMeasure(size=size, rows=rows, seconds=seconds, largest=size, **memory))
    return sizer.size, line


def test_it_doubles_while_it_pays_then_keeps_the_fastest_size():
    sizer = EvalSizer(8, growth_margin=0.05)
    assert [evaluate(sizer, s)[0] for s in (10.0, 6.0, 5.0)] == [16, 32, 64]
    size, line = evaluate(sizer, 4.9)  # 64 is 2% faster than 32: less than the 5% margin
    assert size == 32 and sizer.settled_because is not None
    assert line.startswith("Eval batch settled at 32: 64 ran 204.1 rows/s against 200.0 at 32")
    assert [evaluate(sizer, 5.0)[0] for _ in range(3)] == [32, 32, 32]  # settled: kept
    assert sizer.history == [(8, 100.0), (16, 1000 / 6), (32, 200.0), (64, 1000 / 4.9)]  # (what it measured)


def test_a_doubled_batch_predicted_not_to_fit_is_not_tried():
    sizer = EvalSizer(8, memory_headroom=0.1)
    # 20 GiB allocated before the evaluation, 8 rows peaked 10 GiB above it: 16 would need 40 of the 36 allowed
    memory = dict(base_bytes=20 * GIB, peak_bytes=30 * GIB, limit_bytes=40 * GIB)
    size, line = evaluate(sizer, 10.0, **memory)
    assert size == 8 and line == (
        "Eval batch settled at 8: 16 is predicted to need 40.0 GiB of the 36.0 GiB allowed."
    )
    roomy = EvalSizer(8, memory_headroom=0.1)
    assert evaluate(roomy, 10.0, base_bytes=20 * GIB, peak_bytes=27 * GIB, limit_bytes=40 * GIB)[0] == 16


def test_an_out_of_memory_error_keeps_the_largest_piece_that_ran():
    sizer = EvalSizer(16)
    assert evaluate(sizer, 10.0)[0] == 32
    line = sizer.record(EvalMeasure(size=32, rows=1000, seconds=9.0, largest=8))
    assert (
        sizer.size == 8 and line == "Eval batch settled at 8: an eval batch of 32 ran out of memory; 8 ran."
    )
    # settled, and a later error lowers it again
    assert sizer.record(EvalMeasure(size=8, rows=1000, seconds=9.0, largest=4)).startswith("Eval batch: 4")
    assert sizer.size == 4


def test_it_never_outgrows_the_eval_set():
    sizer = EvalSizer(8)
    assert evaluate(sizer, 1.0, rows=12) == (16, "Eval batch: 16 next (8 ran 12.0 rows/s).")
    assert sizer.batch_size(12) == 12  # the loader gets no more than the rows
    size, line = evaluate(sizer, 0.5, rows=12)
    assert size == 12 and line == "Eval batch settled at 12: 12 holds the whole eval set of 12 rows per rank."
