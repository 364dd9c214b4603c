"""Compile time per program, one at a time: which programs make a cold start slow. For a
mixture-of-experts model, also without the expert-matmul kernel (its small decode steps'
experts in XLA ops instead), since the kernel and the XLA plans compile to different code.

    python benchmarks/program_compile_bench.py --model qwen3-30b-a3b --batches 1 8 32 --prefill
    python benchmarks/program_compile_bench.py --tiny --model qwen3-30b-a3b --batches 1 --prefill   # CPU smoke run

Builds the engine once (dummy weights) and compiles, with one thread, each decode program
of `--batches` at the smallest context bucket, then (`--prefill`) every prefill program of
the engine's buckets (`--chunked-prefill-size` sets how many) for the first variant.
`seconds` is the runner's precompile time of the program: tracing, lowering and XLA's
compile. `--xla-flags` passes XLA flags (e.g. `--xla_gpu_autotune_level=0`, to see how much
of the time autotuning takes). Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import collections
import copy
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MODELS, ensure_importable, model_dir, print_table, write_results  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3-8b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--variants", nargs="+", default=["default"], choices=["default", "no_expert_kernel"],
                    help="no_expert_kernel: a MoE model's experts in XLA ops at every step (needs the Pallas backend)")
    ap.add_argument("--prefill", action="store_true", help="every prefill program too")
    ap.add_argument("--max-context-len", type=int, default=1024)
    ap.add_argument("--chunked-prefill-size", type=int, default=256)
    ap.add_argument("--xla-flags", default="")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default="program_compile.json")
    args = ap.parse_args()
    if args.xla_flags:  # before JAX starts its backend
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + args.xla_flags).strip()
    ensure_importable()
    from jaxoverlap.config import EngineConfig
    from jaxoverlap.engine import Engine
    from jaxoverlap.pallas_kernels.attention import PallasAttention

    max_b = max(args.batches)
    t = time.perf_counter()
    engine = Engine(EngineConfig(
        model=model_dir(MODELS[args.model][1 if args.tiny else 0]), load_format="dummy",
        dtype="float32" if args.tiny else "bfloat16", max_running_requests=max_b,
        max_context_len=args.max_context_len, kv_cache_tokens=max_b * 512,
        chunked_prefill_size=args.chunked_prefill_size,
        attention_backend="pallas" if "no_expert_kernel" in args.variants else "auto",
    ))
    print(f"engine built in {time.perf_counter() - t:.1f} s", flush=True)
    runner = engine.runner
    default_attention = runner.attention
    ctx = runner.decode_ctx_buckets[0]
    rows = []
    for variant in args.variants:
        if variant == "no_expert_kernel":
            if not isinstance(default_attention, PallasAttention):
                raise SystemExit(f"no_expert_kernel needs the Pallas backend, not {default_attention!r}")
            # A copy: the runner keys its programs by the backend, so these compile anew.
            runner.attention = copy.copy(default_attention)
            runner.attention.expert_matmul = None
        else:
            runner.attention = default_attention
        for B in args.batches:
            for r in runner.precompile([B], [ctx], threads=1):
                rows.append({"variant": variant, "program": "decode", "batch": B, "ctx_len": ctx,
                             "seconds": r["seconds"]})
                print(rows[-1], flush=True)
        # Prefill programs once (most are past the kernel's sizes, and they are the long compiles).
        if args.prefill and variant == args.variants[0]:
            for r in runner.precompile([], [ctx], threads=1, prefill=True):  # no batch sizes: no decode program
                rows.append({"variant": variant, "program": "prefill", "batch": r["rows"], "tokens": r["tokens"],
                             "ctx_len": r["ctx_len"], "seconds": r["seconds"]})
                print(rows[-1], flush=True)
    runner.attention = default_attention
    cols = ["variant", "program", "batch", "tokens", "ctx_len", "seconds"]
    print_table(rows, cols)
    totals = collections.Counter()
    for r in rows:
        totals[f"{r['variant']}_{r['program']}_s"] += r["seconds"]
    print(dict(totals))
    write_results(args.out, args, rows, totals=totals)
    engine.close()


if __name__ == "__main__":
    main()
