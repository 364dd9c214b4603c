#!/usr/bin/env python3
"""Prompts arriving together, prefilled as the scheduler plans them (buckets.PrefillShapes.plan:
a token bucket T per batch, prompts cut into rows of at most T tokens): each prefill
step's shape, the padded area (rows x tokens) against the prompt tokens, wall time and time
to first token. Run it on two packages to compare their prefill policies.

Workloads (Qwen3-8B shapes, dummy weights; --tiny for a CPU smoke run), fresh random
tokens every run, prefix cache off:
  single  one prompt of 1088 tokens;
  edge    8 prompts of 1088 tokens;
  mixed   8 prompts of 520 to 1500 tokens;
  short   16 prompts of 300 to 700 tokens (a benchmark's questions).
Each runs `--runs` times after one warm run (every program compiled first).

    python benchmarks/prefill_plan_bench.py --out prefill_plan.json
    python benchmarks/prefill_plan_bench.py --max-prefill-rows 8    # one row per request (the old default)
    python benchmarks/prefill_plan_bench.py --temperature 0.8   # sampled requests (top_p 0.95)
    python benchmarks/prefill_plan_bench.py --tiny          # CPU smoke run
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN3_8B, TINY, ensure_importable, median, model_dir, print_table, write_results  # noqa: E402

WORKLOADS = {
    "single": [1088],
    "edge": [1088] * 8,
    "mixed": [520, 700, 1088, 1300, 1500, 600, 900, 1100],
    "short": [300, 650, 420, 700, 510, 380, 600, 330, 470, 560, 690, 310, 440, 520, 610, 350],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--chunked-prefill-size", type=int, default=2048)
    ap.add_argument("--max-prefill-requests", type=int, default=8)
    ap.add_argument("--max-prefill-rows", type=int, default=None,
                    help="default: one per 32 tokens of the chunk budget (EngineConfig.prefill_rows)")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="prompt lengths times this (--tiny: 1/16, the tiny model's 128-token chunks)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default="prefill_plan.json")
    args = ap.parse_args()
    if args.tiny:
        args.scale, args.chunked_prefill_size = 1 / 16, 128
    ensure_importable()
    from jaxoverlap.config import EngineConfig
    from jaxoverlap.engine import Engine
    from jaxoverlap.sampling_params import SamplingParams

    workloads = {name: [max(1, round(n * args.scale)) for n in lens] for name, lens in WORKLOADS.items()}
    N = max(len(lens) for lens in workloads.values())
    max_context = max(max(lens) for lens in workloads.values()) + args.new_tokens + 16
    engine = Engine(EngineConfig(
        model=model_dir(TINY if args.tiny else QWEN3_8B), load_format="dummy",
        dtype="float32" if args.tiny else "bfloat16", max_running_requests=N, max_context_len=max_context,
        kv_cache_tokens=N * max_context + 1024, page_size=16, max_prefill_requests=args.max_prefill_requests,
        max_prefill_rows=args.max_prefill_rows,
        chunked_prefill_size=args.chunked_prefill_size, disable_prefix_cache=True,
    ))
    runner = engine.runner
    launched = []
    original = runner._launch_prefill

    def traced(batch):
        launched.append((runner._prefill_shape(batch), sum(r.length for r in batch.rows)))
        return original(batch)

    runner._launch_prefill = traced
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    # temperature > 0: the decode steps run the sampling programs (prefill programs sample either way).
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature,
                            top_p=0.95 if args.temperature > 0 else 1.0, seed=0, ignore_eos=True)

    def run(workload: str, label: str):
        launched.clear()
        t0 = time.perf_counter()
        for i, n in enumerate(workloads[workload]):
            engine.add_request(f"{label}-{i}", [int(t) for t in rng.integers(1, vocab, size=n)], params)
        finals = [o for o in engine.drain() if o.finished]
        wall = time.perf_counter() - t0
        ttft = [1e3 * f.metrics.time_to_first_token for f in finals]
        engine.check_integrity()
        return {"workload": workload, "requests": len(finals), "prompt_tokens": sum(workloads[workload]),
                "prefill_steps": len(launched), "padded_area": sum(R * T for (R, T), _ in launched),
                "shapes": [f"{R}x{T}:{real}" for (R, T), real in launched],
                "wall_s": wall, "ttft_median_ms": median(ttft), "ttft_max_ms": max(ttft)}

    for workload in workloads:  # compile every program first
        run(workload, f"warm-{workload}")
    rows = []
    for i in range(args.runs):
        for workload in workloads:
            rows.append(run(workload, f"{workload}-{i}"))
            print(rows[-1], flush=True)
    print_table(rows, ["workload", "requests", "prompt_tokens", "prefill_steps", "padded_area", "wall_s",
                       "ttft_median_ms", "ttft_max_ms"])
    write_results(args.out, args, rows)


if __name__ == "__main__":
    main()
