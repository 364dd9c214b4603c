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


class PrefillShapes:
    """The (rows, tokens) buckets of prefill programs, and the rule that keeps a prefill's
    padded area within the chunk budget.

    A prefill launches R rows of T tokens: the batch's row count and its longest row (plus
    `lead` columns: the speculative prefill's token before the chunk), each rounded up to its
    bucket. Its device time follows R x T, not the tokens it holds (8 x 2048 ran 7.1x as long
    as 1 x 2048 on the H100), so the scheduler keeps R x T within `max_padded_tokens`, the
    chunk budget: a long row does not share a step with other rows padded to its length.
    Shapes above that never run, so the warm-up leaves them out.

    A chunk just past a bucket is cut to the bucket below (`chunk`): 1088 tokens run as
    1024 now and 64 in the next step rather than as 2048.
    """

    # A prefill step's fixed cost, in tokens' worth of device time: reading the weights and
    # the step's launch. Qwen3-8B on the H200 took 10.2 ms for 1 x 128 and 30.6 ms for
    # 1 x 1024, about 7.3 ms plus 0.023 ms a token, so a step costs some 320 tokens; the
    # margin above that keeps the cut to the cases where it clearly pays.
    STEP_COST_TOKENS = 384

    def __init__(self, max_prefill_requests: int, chunked_prefill_size: int, lead: int = 0,
                 step_cost_tokens: int = STEP_COST_TOKENS):
        self.row_buckets = powers_of_two_up_to(max_prefill_requests)
        self.len_buckets = powers_of_two_up_to(chunked_prefill_size, start=min(16, chunked_prefill_size))
        self.lead = lead
        self.max_padded_tokens = chunked_prefill_size
        self.step_cost_tokens = step_cost_tokens

    def shape(self, num_rows: int, longest: int) -> tuple[int, int]:
        """(R, T) of a batch of `num_rows` rows whose longest chunk has `longest` tokens."""
        return pick(self.row_buckets, num_rows), pick(self.len_buckets, self.lead + longest)

    def runs(self, R: int, T: int) -> bool:
        """Whether the scheduler can launch a prefill of this shape."""
        return R * T <= self.max_padded_tokens or R == 1

    def longest_chunk(self, num_rows: int, longest: int) -> int:
        """The most tokens a row may add to a batch of `num_rows` rows whose longest chunk has
        `longest` tokens, so that the batch's shape still runs; 0 if no row fits."""
        if num_rows >= self.row_buckets[-1]:
            return 0
        R = pick(self.row_buckets, num_rows + 1)
        fits = [T for T in self.len_buckets if T >= self.lead + max(longest, 1) and self.runs(R, T)]
        return fits[-1] - self.lead if fits else 0

    def chunk(self, n: int, num_rows: int = 0, longest: int = 0) -> int:
        """How many of a row's next `n` tokens (within the budget) to prefill now, as the next
        row of a batch of `num_rows` rows whose longest chunk has `longest` tokens.

        A chunk that sets the batch's token bucket is cut to the bucket below when that, plus
        the rest's bucket in a step of its own, is less device time than the whole chunk's
        bucket: R x T_below + T_rest + a step's fixed cost < R x T. A chunk within the batch's
        bucket costs nothing more and is not cut."""
        T = pick(self.len_buckets, self.lead + n)
        if num_rows and T <= pick(self.len_buckets, self.lead + max(longest, 1)):
            return n
        lower = [b for b in self.len_buckets if self.lead < b < self.lead + n]
        if not lower:
            return n
        now = lower[-1] - self.lead
        R = pick(self.row_buckets, num_rows + 1)
        rest = pick(self.len_buckets, self.lead + n - now)
        return now if R * lower[-1] + rest + self.step_cost_tokens < R * T else n
