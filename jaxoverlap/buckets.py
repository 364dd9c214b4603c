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
    """The (rows, tokens) buckets of prefill programs, and the plan of each prefill batch.

    A prefill launches R rows of T tokens: the batch's row count and its longest row (plus
    `lead` columns: the speculative prefill's token before the chunk), each rounded up to its
    bucket. Its device time follows R x T, not the tokens it holds (8 x 2048 ran 7.1x as long
    as 1 x 2048 on the H100), so R x T stays within `max_padded_tokens`, the chunk budget;
    shapes above that never run, and the warm-up leaves them out.

    A row is a segment of one request's prompt, not a whole chunk: `plan` picks the bucket T,
    and each request's chunk is cut into rows of at most T - lead tokens, which one batch
    takes together (within a layer every row's K/V is written before any row attends, so a
    segment sees the ones before it). Eight prompts of 1088 tokens that arrive together then
    run in five steps, four of them 32 x 64 (8 x 256 with 8 rows), rather than in eight
    steps of 1 x 2048; a lone prompt of 1088 runs as 1024, then 64, rather than 2048.
    """

    # A prefill step's fixed cost, in tokens' worth of device time: reading the weights and
    # the step's launch. Qwen3-8B on the H200 took 10.2 ms for 1 x 128 and 30.6 ms for
    # 1 x 1024, about 7.3 ms plus 0.023 ms a token, so a step costs some 320 tokens; the
    # margin above that favours fewer, fuller steps.
    STEP_COST_TOKENS = 384

    def __init__(self, max_rows: int, chunked_prefill_size: int, lead: int = 0,
                 step_cost_tokens: int = STEP_COST_TOKENS, max_requests: int | None = None):
        self.row_buckets = powers_of_two_up_to(max_rows)
        self.max_requests = max_requests  # of one step (None: a request per row at most)
        self.len_buckets = powers_of_two_up_to(chunked_prefill_size, start=min(16, chunked_prefill_size))
        self.lead = lead
        self.max_padded_tokens = chunked_prefill_size
        self.step_cost_tokens = step_cost_tokens

    def shape(self, num_rows: int, longest: int) -> tuple[int, int]:
        """(R, T) of a batch of `num_rows` rows whose longest chunk has `longest` tokens."""
        return pick(self.row_buckets, num_rows), pick(self.len_buckets, self.lead + longest)

    def sampled_rows(self, R: int) -> int:
        """How many rows of an R-row prefill can end a request's chunk (its last segment),
        so need the token sampled after them: one per request the step may hold."""
        return R if self.max_requests is None else min(R, self.max_requests)

    def runs(self, R: int, T: int) -> bool:
        """Whether the scheduler can launch a prefill of this shape."""
        return R * T <= self.max_padded_tokens or R == 1

    def plan(self, pending: list[int]) -> tuple[int, int]:
        """(T, R) of the next prefill: the most tokens a row may hold plus `lead` (a length
        bucket), and the most rows it may take, for the prompt tokens left to prefill of the
        requests it would take, in order (the first may be mid-prompt; each at most the
        budget). Each request is cut into rows of at most T - lead tokens, and the batch
        takes the first R rows; what it leaves runs in the next steps.

        Device time is counted as R x T plus a step's fixed cost. With a budget's worth of
        tokens pending, every step can be full: the plan holds the most tokens per unit of
        device time (eight prompts of 1088 tokens: 32 x 64, or 8 x 256 with 8 rows). With
        less, the plan is the cheapest way to prefill all of it, this step and what it
        leaves in steps of one shape after it: 1088 tokens alone run as 1024 + 64 (1856
        tokens' worth, two step costs included, against 2432 for one step of 2048), but
        1624 as one step of 2048.
        Ties go to more tokens now, then to fewer rows."""
        c = self.step_cost_tokens
        heavy = sum(pending) >= self.max_padded_tokens
        caps = [T - self.lead for T in self.len_buckets]
        # after[k][j]: rows of at most caps[k] tokens that requests j.. need, for the cost of a
        # rest (the requests a plan leaves whole); only the light case counts rests.
        after = [[0] * (len(pending) + 1) for _ in caps]
        if not heavy:
            for j in range(len(pending) - 1, -1, -1):
                for k, cap in enumerate(caps):
                    after[k][j] = after[k][j + 1] + (-(-pending[j] // cap) if cap > 0 else 0)
        best_key, best = None, (self.len_buckets[-1], 1)
        for T, cap in zip(self.len_buckets, caps):
            if cap < 1:
                continue
            rows, owner = [], []  # each row's tokens and request
            for i, n in enumerate(pending):
                while n > 0 and len(rows) < self.row_buckets[-1]:
                    rows.append(min(cap, n))
                    owner.append(i)
                    n -= rows[-1]
                if len(rows) == self.row_buckets[-1]:
                    break
            for R in self.row_buckets:
                if not self.runs(R, T):
                    break
                tokens = sum(rows[:R])
                if heavy:
                    key = (tokens / (R * T + c), tokens, -R)
                else:
                    j = owner[min(R, len(rows)) - 1]  # the last request with a row in the plan
                    taken = sum(n for i, n in zip(owner[:R], rows[:R]) if i == j)
                    rest = pending[j] - taken  # of request j; requests after j are left whole
                    cost = R * T + c
                    if rest or j + 1 < len(pending):
                        cost += self._rest_cost(caps, after, j + 1, rest)
                    key = (-cost, tokens, -R)
                if best_key is None or key > best_key:
                    best_key, best = key, (T, R)
                if R >= len(rows):  # more rows would be padding
                    break
        return best

    def _rest_cost(self, caps, after, j: int, partial: int) -> int:
        """Device time (R x T + step cost per step) of the cheapest way to prefill what a plan
        leaves, `partial` tokens of one request and requests j.. whole (`after`), in steps
        of one shape and as many rows as run (the last step with the rows left)."""
        best = None
        for T, cap, rows_after in zip(self.len_buckets, caps, after):
            if cap < 1:
                continue
            num_rows = max(-(-partial // cap) + rows_after[j], 1)
            most = max(R for R in self.row_buckets if self.runs(R, T))
            full, last = divmod(num_rows, most)
            cost = full * (most * T + self.step_cost_tokens)
            if last:
                cost += pick(self.row_buckets, last) * T + self.step_cost_tokens
            best = cost if best is None else min(best, cost)
        return best
