#!/usr/bin/env python3
"""Requests that arrive together with one prompt: what sharing its pages from the moment its
prefill is scheduled saves (Scheduler._share_prefilled_pages).

Two workloads, Qwen3-8B shapes with dummy weights (or --tiny on a CPU):
  samples  N requests of one P-token prompt, sampled with N seeds (pass@k, self-consistency);
  system   N requests of one S-token system prompt plus U tokens of their own.
Each runs with the prefix cache on and off, in the order on, off, off, on (drift spreads
over both), every run on fresh random tokens so that no run finds an earlier one's pages.
Reported per run: prompt tokens the engine prefilled (prompt minus cached), wall time until
every request finished, median and max time to first token.

    python benchmarks/shared_prompt_bench.py --out shared_prompt.json
    python benchmarks/shared_prompt_bench.py --tiny          # CPU smoke run
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN3_8B, TINY, ensure_importable, median, model_dir, print_table, write_results  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=2048, help="samples: P")
    ap.add_argument("--system-len", type=int, default=1024, help="system: S")
    ap.add_argument("--user-len", type=int, default=64, help="system: U")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--chunked-prefill-size", type=int, default=2048)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default="shared_prompt.json")
    args = ap.parse_args()
    ensure_importable()
    from jaxoverlap.config import EngineConfig
    from jaxoverlap.engine import Engine
    from jaxoverlap.sampling_params import SamplingParams

    N = args.num_requests
    longest = max(args.prompt_len, args.system_len + args.user_len)
    max_context = longest + args.new_tokens + 16
    engine = Engine(EngineConfig(
        model=model_dir(TINY if args.tiny else QWEN3_8B), load_format="dummy",
        dtype="float32" if args.tiny else "bfloat16", max_running_requests=N, max_context_len=max_context,
        kv_cache_tokens=N * max_context + 1024, page_size=16, max_prefill_requests=N,
        chunked_prefill_size=args.chunked_prefill_size,
    ))
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    prefix = engine.scheduler.prefix

    def tokens(n):
        return [int(t) for t in rng.integers(1, vocab, size=n)]

    def requests(workload):
        if workload == "samples":
            prompt = tokens(args.prompt_len)
            return [(prompt, SamplingParams(max_new_tokens=args.new_tokens, temperature=0.8, seed=i, ignore_eos=True))
                    for i in range(N)]
        system = tokens(args.system_len)
        return [(system + tokens(args.user_len), SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0,
                                                                ignore_eos=True)) for _ in range(N)]

    def run(workload, cache: bool, label: str):
        engine.scheduler.pages.free(prefix.evict(prefix.num_pages))  # nothing left from the last run
        prefix.enabled = cache
        reqs = requests(workload)
        t0 = time.perf_counter()
        for i, (prompt, params) in enumerate(reqs):
            engine.add_request(f"{label}-{i}", prompt, params)
        finals = [o for o in engine.drain() if o.finished]
        wall = time.perf_counter() - t0
        prompt_tokens = sum(f.metrics.prompt_tokens for f in finals)
        cached = sum(f.metrics.cached_prompt_tokens for f in finals)
        ttft = [1e3 * f.metrics.time_to_first_token for f in finals]
        engine.check_integrity()
        return {"workload": workload, "prefix_cache": "on" if cache else "off", "requests": len(finals),
                "prompt_tokens": prompt_tokens, "prefilled_tokens": prompt_tokens - cached, "wall_s": wall,
                "ttft_median_ms": median(ttft), "ttft_max_ms": max(ttft)}

    for workload in ("samples", "system"):  # compile every program first
        for cache in (True, False):
            run(workload, cache, f"warm-{workload}-{cache}")
    rows = []
    for workload in ("samples", "system"):
        for i, cache in enumerate((True, False, False, True)):
            rows.append(run(workload, cache, f"{workload}-{i}"))
            print(rows[-1], flush=True)
    print_table(rows, ["workload", "prefix_cache", "requests", "prompt_tokens", "prefilled_tokens", "wall_s",
                       "ttft_median_ms", "ttft_max_ms"])
    summary = {}
    for workload in ("samples", "system"):
        on = [r["wall_s"] for r in rows if r["workload"] == workload and r["prefix_cache"] == "on"]
        off = [r["wall_s"] for r in rows if r["workload"] == workload and r["prefix_cache"] == "off"]
        summary[workload] = {"wall_off_over_on": float(np.mean(off) / np.mean(on))}
    print("summary", summary)
    write_results(args.out, args, rows, summary=summary)


if __name__ == "__main__":
    main()
