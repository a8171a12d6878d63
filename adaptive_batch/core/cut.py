"""Where to cut one step's rows into micro-batches by tokens: the fewest micro-batches, or the least compute.

A step's rows are taken longest first, so a run of consecutive rows is a micro-batch of similar lengths, padded to
its longest. Two objectives, both under a budget of tokens per micro-batch (a row longer than the budget alone) and
at most `row_cap` rows:

- `fewest_chunks`: as few micro-batches as possible, then the lowest peak (a stated budget with nothing measured).
- `cheapest_chunks` (padded rows): the least modelled time, `overhead` x micro-batches + padded tokens, where `overhead` is the
  fixed cost of one micro-batch (kernel launches, the optimizer-free part of a forward/backward that does not grow
  with tokens) in tokens' worth of time. A large overhead gives the fewest micro-batches; a small one cuts wherever
  a shorter run of rows saves more padding than a micro-batch costs. Computed exactly by dynamic programming.

Cutting only into runs of the longest-first order loses nothing: swapping a longer row of a micro-batch whose
longest row is shorter with a shorter row of one whose longest row is longer changes no micro-batch's row count and
lowers no padded length, so some best cut is made of runs.

A micro-batch's tokens are its rows x its longest row (rows padded to it), or with `packed` the sum of its lengths
(padding-free sequences, kept in their order: every cut runs the same tokens, so the fewest is also the cheapest).

Pure Python: no torch, no transformers.
"""

from __future__ import annotations


def fewest_chunks(lengths: list[int], budget: int, row_cap: int | None, packed: bool = False) -> list[int]:
    """Cut `lengths` in order into as few chunks of at most `budget` tokens as they allow (a longer row alone), at
    most `row_cap` rows each, then with the least budget that keeps that count (a lower peak, no more chunks)."""
    count = len(_greedy_chunks(lengths, budget, row_cap, packed))
    # the least budget that still gives `count` micro-batches (a smaller budget never gives fewer)
    low, high = 1, budget
    while low < high:
        middle = (low + high) // 2
        if len(_greedy_chunks(lengths, middle, row_cap, packed)) <= count:
            high = middle
        else:
            low = middle + 1
    return _greedy_chunks(lengths, low, row_cap, packed)


def cheapest_chunks(lengths: list[int], budget: int, row_cap: int | None, overhead: int) -> list[int]:
    """Cut `lengths` in order into chunks of at most `budget` tokens (a longer row alone) and `row_cap` rows that
    minimise `overhead` x chunks + tokens; among equal costs, the fewest chunks, then the lowest peak.

    Example: lengths 100, 100, 10, 10 with a budget of 400 and an overhead of 50 give 2, 2 (200 + 20 tokens and
    2 x 50: 320), not 4 (400 + 50: 450); with an overhead of 200, 4 (600 against 620).
    """
    count = len(lengths)
    # best[end]: (cost, chunks, peak) of the best cut of the first `end` rows; last[end]: where its last chunk starts
    best: list[tuple[int, int, int] | None] = [(0, 0, 0)] + [None] * count
    last = [0] * (count + 1)
    for start in range(count):
        before = best[start]
        longest = 0
        for end in range(start + 1, count + 1):
            size = end - start
            if row_cap is not None and size > row_cap:
                break
            longest = max(longest, lengths[end - 1])
            tokens = size * longest
            if size > 1 and tokens > budget:  # more rows only add tokens
                break
            candidate = (before[0] + overhead + tokens, before[1] + 1, max(before[2], tokens))
            if best[end] is None or candidate < best[end]:
                best[end], last[end] = candidate, start
    sizes, end = [], count
    while end > 0:
        sizes.append(end - last[end])
        end = last[end]
    return sizes[::-1]


def _greedy_chunks(lengths: list[int], budget: int, row_cap: int | None, packed: bool = False) -> list[int]:
    """Cut `lengths` in order: each chunk takes rows while its tokens stay within `budget`."""
    sizes, start = [], 0
    while start < len(lengths):
        size, longest, total = 1, lengths[start], lengths[start]
        while start + size < len(lengths) and (row_cap is None or size < row_cap):
            longer, more = max(longest, lengths[start + size]), total + lengths[start + size]
            if (more if packed else (size + 1) * longer) > budget:
                break
            size, longest, total = size + 1, longer, more
        sizes.append(size)
        start += size
    return sizes
