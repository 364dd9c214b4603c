"""Padded sizes for the jitted steps: each distinct size is one compiled program."""
from __future__ import annotations

import bisect


def powers_of_two_up_to(limit: int, start: int = 1) -> tuple[int, ...]:
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    out.append(limit)
    return tuple(sorted(set(out)))


def pick(buckets: tuple[int, ...], n: int) -> int:
    """The smallest bucket >= n."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"size {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def next_power_of_two(n: int, minimum: int = 1) -> int:
    b = minimum
    while b < n:
        b *= 2
    return b
