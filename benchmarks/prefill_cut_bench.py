#!/usr/bin/env python3
"""Prompts just past a token bucket, with the scheduler's chunk cut on and off
(buckets.PrefillShapes.chunk): a 1088-token prompt runs as 1024 + 64 rather than as 2048.

Workloads (Qwen3-8B shapes, dummy weights; --tiny for a CPU smoke run), prompts arriving
together, fresh random tokens every run:
  single  one prompt of 1088 tokens: its time to first token alone;
  edge    8 prompts of 1088 tokens;
  mixed   8 prompts of 520 to 1500 tokens.
Each runs with the cut on and off, in the order on, off, off, on, after one warm run of
each (every program compiled first). Reported per run: wall time until every request
finished, median and max time to first token, prefill steps launched, and their padded area
(rows x tokens, summed) against the prompt tokens they held.

    python benchmarks/prefill_cut_bench.py --out prefill_cut.json
    python benchmarks/prefill_cut_bench.py --tiny          # CPU smoke run
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
}
NO_CUT = 10**9  # a step cost no cut can beat


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--chunked-prefill-size", type=int, default=2048)
    ap.add_argument("--scale", type=float, default=1.0,
                    help="prompt lengths times this (--tiny: 1/16, the tiny model's 128-token chunks)")
    ap.add_argument("--step-cost", type=int, default=None,
                    help="the cut's step cost in tokens (default: the engine's; --tiny: 0)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default="prefill_cut.json")
    args = ap.parse_args()
    if args.tiny:  # the tiny model's steps cost next to nothing: cut whenever the area shrinks
        args.scale, args.chunked_prefill_size, args.step_cost = 1 / 16, 128, 0
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
        kv_cache_tokens=N * max_context + 1024, page_size=16, max_prefill_requests=N,
        chunked_prefill_size=args.chunked_prefill_size, disable_prefix_cache=True,
    ))
    runner, shapes = engine.runner, engine.scheduler.cfg.prefill_shapes
    step_cost = shapes.step_cost_tokens if args.step_cost is None else args.step_cost
    launched = []
    original = runner._launch_prefill

    def traced(batch):
        launched.append((runner._prefill_shape(batch), sum(r.length for r in batch.rows)))
        return original(batch)

    runner._launch_prefill = traced
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)

    def run(workload: str, cut: bool, label: str):
        shapes.step_cost_tokens = step_cost if cut else NO_CUT
        launched.clear()
        t0 = time.perf_counter()
        for i, n in enumerate(workloads[workload]):
            engine.add_request(f"{label}-{i}", [int(t) for t in rng.integers(1, vocab, size=n)], params)
        finals = [o for o in engine.drain() if o.finished]
        wall = time.perf_counter() - t0
        ttft = [1e3 * f.metrics.time_to_first_token for f in finals]
        engine.check_integrity()
        return {"workload": workload, "cut": "on" if cut else "off", "requests": len(finals),
                "prompt_tokens": sum(workloads[workload]), "prefill_steps": len(launched),
                "padded_area": sum(R * T for (R, T), _ in launched),
                "shapes": [f"{R}x{T}:{real}" for (R, T), real in launched],
                "wall_s": wall, "ttft_median_ms": median(ttft), "ttft_max_ms": max(ttft)}

    for workload in workloads:  # compile every program first
        for cut in (True, False):
            run(workload, cut, f"warm-{workload}-{cut}")
    rows = []
    for workload in workloads:
        for i, cut in enumerate((True, False, False, True)):
            rows.append(run(workload, cut, f"{workload}-{i}"))
            print(rows[-1], flush=True)
    print_table(rows, ["workload", "cut", "requests", "prompt_tokens", "prefill_steps", "padded_area", "wall_s",
                       "ttft_median_ms", "ttft_max_ms"])
    summary = {}
    for workload in workloads:
        def mean(key, cut):
            return float(np.mean([r[key] for r in rows if r["workload"] == workload and r["cut"] == cut]))
        summary[workload] = {"wall_off_over_on": mean("wall_s", "off") / mean("wall_s", "on"),
                             "ttft_median_off_over_on": mean("ttft_median_ms", "off") / mean("ttft_median_ms", "on"),
                             "area_off_over_on": mean("padded_area", "off") / mean("padded_area", "on")}
    print("summary", summary)
    write_results(args.out, args, rows, summary=summary)


if __name__ == "__main__":
    main()
