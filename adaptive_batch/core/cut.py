"""Where to cut one step's rows, longest first, into runs of consecutive rows (some best cut is made of runs) under a
token budget and a row cap. See docs/how-it-works.md, "Variable-length data". Pure Python."""

from __future__ import annotations


def fewest_chunks(lengths: list[int], budget: int, row_cap: int | None, packed: bool = False) -> list[int]:
    """As few chunks as the budget allows, then the least budget that keeps that count (a lower peak); for a stated
    budget with nothing measured, and padding-free sequences (every cut runs the same tokens)."""
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
    """The chunks minimising `overhead` x chunks + padded tokens (dynamic programming); ties: fewest, lowest peak."""
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
