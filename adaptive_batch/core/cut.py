"""Where to cut one step's rows, longest first, into runs of consecutive rows (some best cut is made of runs) under a
token budget and a row cap. See docs/how-it-works.md, "Variable-length data". Pure Python."""

from __future__ import annotations


def fewest_chunks(
    lengths: list[int], budget: int, row_cap: int | None, packed: bool = False, width: int | None = None
) -> list[int]:
    """As few chunks as the budget allows, then the least budget that keeps that count (a lower peak); for a stated
    budget with nothing measured, and padding-free sequences (every cut runs the same tokens; `width`: packed into
    rows of that many tokens, [`rows_first_fit`], a chunk's tokens its rows')."""
    count = len(_greedy_chunks(lengths, budget, row_cap, packed, width))
    # the least budget that still gives `count` micro-batches (a smaller budget never gives fewer)
    low, high = 1, budget
    while low < high:
        middle = (low + high) // 2
        if len(_greedy_chunks(lengths, middle, row_cap, packed, width)) <= count:
            high = middle
        else:
            low = middle + 1
    return _greedy_chunks(lengths, low, row_cap, packed, width)


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


def rows_first_fit(lengths: list[int], width: int) -> list[list[int]]:
    """Sequences of `lengths` (each at most `width`) packed in order into rows of `width` tokens, each into the first
    row with room: the indices each row holds (longest first, this is first fit decreasing)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for index, length in enumerate(lengths):
        row = next((r for r, left in enumerate(room) if left >= length), len(rows))
        if row == len(rows):
            rows.append([])
            room.append(width)
        rows[row].append(index)
        room[row] -= length
    return rows


def _greedy_chunks(
    lengths: list[int], budget: int, row_cap: int | None, packed: bool = False, width: int | None = None
) -> list[int]:
    sizes, start = [], 0
    while start < len(lengths):
        size, longest, total = 1, lengths[start], lengths[start]
        room = [width - lengths[start]] if width else []  # what each row of the chunk has left, first fit
        while start + size < len(lengths) and (row_cap is None or size < row_cap):
            length = lengths[start + size]
            longer, more = max(longest, length), total + length
            if width:  # the chunk's tokens are its rows'
                row = next((r for r, left in enumerate(room) if left >= length), len(room))
                tokens = max(len(room), row + 1) * width
            else:
                tokens = more if packed else (size + 1) * longer
            if tokens > budget:
                break
            if width:
                if row == len(room):
                    room.append(width)
                room[row] -= length
            size, longest, total = size + 1, longer, more
        sizes.append(size)
        start += size
    return sizes
