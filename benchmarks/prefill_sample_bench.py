#!/usr/bin/env python3
"""What the end of a prefill step costs the device: the LM head and the sampler (a sort
over the vocabulary per row) after each row (`steps.sample_after_chunks`), for every row of
an R-row prefill against only one row per request (8 requests, the engine's default).

Qwen3-8B's LM head (hidden 4096, vocab 151936, bf16) with random weights; R rows are the
segments of 8 requests' chunks (R / 8 each), sampled (temperature 0.8, top-p 0.95).
Device time per call: back-to-back calls, the median of --repeats timings of --iters.

    python benchmarks/prefill_sample_bench.py --out prefill_sample.json
    python benchmarks/prefill_sample_bench.py --tiny      # CPU smoke run
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN3_8B, TINY, ensure_importable, median, print_table, write_results  # noqa: E402

Head = collections.namedtuple("Head", "lm_head embed")  # what lm_logits reads of ModelParams


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default="prefill_sample.json")
    args = ap.parse_args()
    ensure_importable()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxoverlap.steps import sample_after_chunks

    cfg = TINY if args.tiny else QWEN3_8B
    D, V = cfg["hidden_size"], cfg["vocab_size"]
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    key = jax.random.PRNGKey(0)
    lm_head = (jax.random.normal(key, (D, V), jnp.float32) * 0.02).astype(dtype)

    @functools.partial(jax.jit, static_argnames=("count",))
    def tail(lm_head, hidden, entries, starts, kv_lens, row_params, *, count):
        return sample_after_chunks(Head(lm_head, None), hidden, entries, starts, kv_lens, row_params, None,
                                   count=count, sampling=True, top_logprobs=False)

    def timed(fn) -> float:
        jax.block_until_ready(fn())  # compile, and a first run
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            for _ in range(args.iters):
                out = fn()
            jax.block_until_ready(out)
            times.append(1e3 * (time.perf_counter() - t) / args.iters)
        return median(times)

    rows = []
    for R in args.rows:
        per = max(1, R // args.requests)  # segments per request, each 32 tokens
        entries = np.array([1 + i // per for i in range(R)], np.int32)
        starts = np.array([32 * (i % per) for i in range(R)], np.int32)
        kv_lens = starts + 32
        row_params = (np.full(R, 0.8, np.float32), np.zeros(R, np.int32), np.full(R, 0.95, np.float32),
                      np.zeros(R, np.float32), np.arange(R, dtype=np.uint32))
        hidden = jax.random.normal(jax.random.PRNGKey(R), (R, D), jnp.float32).astype(dtype)
        args_ = (lm_head, hidden, jnp.asarray(entries), jnp.asarray(starts), jnp.asarray(kv_lens),
                 tuple(jnp.asarray(x) for x in row_params))
        every = timed(lambda: tail(*args_, count=R))
        count = min(R, args.requests)
        last = timed(lambda: tail(*args_, count=count))
        rows.append({"rows": R, "requests": count, "every_row_ms": every, "one_per_request_ms": last,
                     "saved_ms": every - last})
        print(rows[-1], flush=True)
    print_table(rows, ["rows", "requests", "every_row_ms", "one_per_request_ms", "saved_ms"])
    write_results(args.out, args, rows)


if __name__ == "__main__":
    main()
