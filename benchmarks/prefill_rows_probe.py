#!/usr/bin/env python3
"""Each engine step of shared_prompt_bench's 'system' workload (N prompts sharing one system
prompt, arriving together), timed, with the (rows, tokens) shape of the prefill it
launched and the programs compiled meanwhile: how it found that padded prefill rows cost
their padded size, and that padded tokens written to one slot serialized the KV scatter
(benchmarks/RESULTS.md, 2026-12-05, seventh session). Qwen3-8B shapes, dummy weights;
--tiny for a CPU smoke run. Prints one line per step, writes JSON.

    python benchmarks/prefill_rows_probe.py --out prefill_rows.json
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN3_8B, TINY, ensure_importable, model_dir, write_results  # noqa: E402


class _CompileCounter(logging.Handler):
    def __init__(self):
        super().__init__()
        self.count = 0

    def emit(self, record):
        if "Compiling" in record.getMessage():
            self.count += 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--user-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--chunked-prefill-size", type=int, default=2048)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default="prefill_rows.json")
    args = ap.parse_args()
    ensure_importable()
    import jax

    from jaxoverlap.config import EngineConfig
    from jaxoverlap.engine import Engine
    from jaxoverlap.sampling_params import SamplingParams

    jax.config.update("jax_log_compiles", True)
    counter = _CompileCounter()
    logging.getLogger("jax").addHandler(counter)
    N = args.num_requests
    max_context = args.system_len + args.user_len + args.new_tokens + 16
    engine = Engine(EngineConfig(
        model=model_dir(TINY if args.tiny else QWEN3_8B), load_format="dummy",
        dtype="float32" if args.tiny else "bfloat16", max_running_requests=N, max_context_len=max_context,
        kv_cache_tokens=N * max_context + 1024, page_size=16, max_prefill_requests=N,
        chunked_prefill_size=args.chunked_prefill_size,
    ))
    runner, sched = engine.runner, engine.scheduler
    shapes = []
    original = runner._launch_prefill

    def traced(batch):
        shapes.append((runner._prefill_shape(batch), [r.length for r in batch.rows], runner._ctx_len(batch)))
        return original(batch)

    runner._launch_prefill = traced
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    rows = []
    for run in range(args.runs):
        for cache in (True, False):
            sched.pages.free(sched.prefix.evict(sched.prefix.num_pages))
            sched.prefix.enabled = cache
            system = [int(t) for t in rng.integers(1, vocab, size=args.system_len)]
            for i in range(N):
                user = [int(t) for t in rng.integers(1, vocab, size=args.user_len)]
                engine.add_request(f"{run}-{cache}-{i}", system + user,
                                   SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True))
            k = 0
            while engine.has_work():
                shapes.clear()
                c0 = counter.count
                t = time.perf_counter()
                engine.step()
                dt = 1e3 * (time.perf_counter() - t)
                row = {"run": run, "cache": cache, "step": k, "ms": round(dt, 2), "compiles": counter.count - c0,
                       "launched_prefill": [(list(s), lens, ctx) for s, lens, ctx in shapes]}
                print(row, flush=True)
                rows.append(row)
                k += 1
    write_results(args.out, args, rows)


if __name__ == "__main__":
    main()
