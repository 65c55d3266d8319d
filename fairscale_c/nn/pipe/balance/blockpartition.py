"""Splitting a sequence of costs into contiguous blocks of similar total cost.

The heuristic of Bárány and Grinberg, "Block partitions of sequences" (arXiv:1308.2452), which
FairScale's balance helpers use: start from equal-length blocks and move one element at a time
from a neighbour of the smallest block towards it, until the largest block exceeds the smallest
by at most one (in units of the normalised cost range).
"""

from __future__ import annotations

from typing import List


def solve(sequence: List[int], partitions: int = 1) -> List[List[int]]:
    """The blocks (sub-lists of `sequence`, in order, each non-empty)."""
    if partitions < 1:
        raise ValueError(f"partitions must be a positive integer ({partitions} < 1)")
    n = len(sequence)
    if n < partitions:
        raise ValueError(f"sequence is shorter than intended partitions ({n} < {partitions})")
    low = min(sequence)
    span = max(sequence) - low
    costs = [0.0] * n if span == 0 else [(x - low) / span for x in sequence]
    # ends[b] is one past the last element of block b.
    ends = [n // partitions * (b + 1) for b in range(partitions - 1)] + [n]

    def size(b: int) -> float:
        return sum(costs[(ends[b - 1] if b else 0) : ends[b]])

    while True:
        biggest, p = max((size(b), b) for b in range(partitions))
        while True:
            smallest, q = min((size(b), b) for b in range(partitions))
            if biggest <= smallest + 1:
                starts = [0] + ends[:-1]
                return [sequence[s:e] for s, e in zip(starts, ends)]
            if p < q:
                h = q - 1
                ends[h] -= 1  # the last element of block q-1 moves into block q
            else:
                h = q + 1
                ends[q] += 1  # the first element of block q+1 moves into block q
            if h == p:
                break
